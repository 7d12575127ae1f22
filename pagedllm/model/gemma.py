"""Gemma 2 and Gemma 3 (text): Llama's projections in a layer of their own shape.

- Every norm is (1 + weight) RMSNorm, computed in float32 and rounded once (`GemmaRMSNorm`); each
  layer has four: before and after the attention, before and after the MLP ("sandwich"), the
  residual added after the post-norms.
- Embeddings are scaled by sqrt(hidden_size), rounded to the model's dtype first as
  transformers does; attention scores by query_pre_attn_scalar ** -0.5; the MLP is gated GELU
  (tanh approximation).
- Gemma 2: attention scores soft-capped (attn_logit_softcapping) and final logits too
  (final_logit_softcapping); layers alternate sliding-window and global attention.
- Gemma 3: an RMSNorm over each query and key head, five sliding layers to one global
  (sliding_window_pattern), each kind with its own rotary (rope_local_base_freq for the sliding
  ones, rope_scaling for the global ones); no attention soft-cap (transformers' Gemma 3 applies
  none, whatever the config says).

GGUF (`gemma2`, `gemma3`): llama.cpp stores the norms as 1 + weight, read back here.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.decoder import DecoderForCausalLM
from pagedllm.model.layers import VocabParallelEmbedding
from pagedllm.model.llama import LlamaAttention
from pagedllm.model.mlp import GatedMLP
from pagedllm.model.norms import GemmaRMSNorm
from pagedllm.model.rotary import RotaryEmbedding
from pagedllm.model.weights import LazyWeight, ShiftedWeight
from pagedllm.transformers_utils.arch import ModelArchConfig
from pagedllm.transformers_utils.families import FAMILIES


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer: int, rotary, backend, tp, dtype):
        super().__init__()
        norm = lambda: GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = LlamaAttention(cfg, layer, rotary, backend, tp, dtype, head_norm=GemmaRMSNorm)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, False, tp, dtype)
        self.post_feedforward_layernorm = norm()

    def forward(self, positions, hidden, residual, metadata):
        """As Llama's layer (the residual add fused into the next norm: `hidden` is the previous
        layer's output, not yet added to `residual`; residual None in the first layer), with
        the attention's and the MLP's outputs normed before they join the stream."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual

    def fused(self):
        """This layer as the C++ layer loop reads it (`model.fused_layers`)."""
        from pagedllm.model.fused_layers import FusedLayer, norm_weight

        attn = self.self_attn
        heads = {}
        if attn.q_norm is not None:
            heads = dict(q_norm=norm_weight(attn.q_norm), k_norm=norm_weight(attn.k_norm))
        return FusedLayer(norm_weight(self.input_layernorm), norm_weight(self.pre_feedforward_layernorm),
                          attn.qkv_proj, attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj, attn.attn,
                          attn.rotary, self.mlp.hidden_act, attn_out_norm=norm_weight(self.post_attention_layernorm),
                          mlp_out_norm=norm_weight(self.post_feedforward_layernorm), **heads)


class GemmaModel(nn.Module):
    def __init__(self, cfg: ModelArchConfig, max_position: int, backend, tp, dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.register_buffer("normalizer", torch.tensor(cfg.hidden_size**0.5, dtype=dtype), persistent=False)
        # One rotary per distinct (base, scaling): Gemma 3's sliding and global layers differ.
        rotaries: dict[str, RotaryEmbedding] = {}
        layer_rotary = []
        for layer in range(cfg.num_layers):
            theta, scaling = cfg.layer_rope(layer)
            key = repr((theta, scaling))
            if key not in rotaries:
                rotaries[key] = RotaryEmbedding(cfg.head_dim, max_position, theta, scaling, dtype)
            layer_rotary.append(rotaries[key])
        self.rotaries = nn.ModuleList(rotaries.values())
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, layer, layer_rotary[layer], backend, tp, dtype) for layer in range(cfg.num_layers)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.fused_layers = None  # the layer loop as one C++ call where it applies (set by the worker)

    def forward(self, input_ids, positions, metadata):
        if self.fused_layers is not None and self.fused_layers.applies(input_ids, metadata):
            return self.fused_layers(positions, input_ids, metadata)  # (the lookup, scaling and final norm included)
        hidden = self.embed_tokens(input_ids) * self.normalizer
        table = {id(r): r.table_positions(positions, metadata) for r in self.rotaries}
        residual = None
        for layer in self.layers:
            hidden, residual = layer(table[id(layer.self_attn.rotary)], hidden, residual, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma2ForCausalLM(DecoderForCausalLM):
    gguf_layer_tensors = FAMILIES["Gemma2ForCausalLM"].gguf_layer_tensors

    def build_model(self, max_position, backend, tp, dtype) -> GemmaModel:
        return GemmaModel(self.cfg, max_position, backend, tp, dtype)

    def fused_decoder_plan(self):
        """Gemma's layers as the C++ layer loop reads them, on one rank."""
        from pagedllm.model.fused_layers import FusedDecoderPlan, norm_weight

        if self.tp.size != 1:
            return None
        return FusedDecoderPlan([block.fused() for block in self.model.layers], self.cfg.rms_norm_eps,
                                norm_weight(self.model.norm), self.model.embed_tokens,
                                embed_scale=float(self.model.normalizer))

    def layer_projections(self, layer: int) -> dict[str, nn.Parameter]:
        block = self.model.layers[layer]
        return {"qkv_proj": block.self_attn.qkv_proj.weight, "o_proj": block.self_attn.o_proj.weight,
                "gate_up_proj": block.mlp.gate_up_proj.weight, "down_proj": block.mlp.down_proj.weight}

    @classmethod
    def gguf_weight(cls, hf_name: str, weight: LazyWeight) -> LazyWeight:
        # llama.cpp's converter adds 1 to every Gemma norm weight (its RMSNorm multiplies by w).
        return ShiftedWeight(weight, -1.0) if hf_name.endswith("norm.weight") else weight


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    gguf_layer_tensors = FAMILIES["Gemma3ForCausalLM"].gguf_layer_tensors
