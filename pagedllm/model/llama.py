"""Llama-shaped decoders over a flat batch of tokens and a paged KV cache: Llama, Mistral and
Qwen2 here, and the families built from the same layers (Qwen3 adds q/k norms, Phi-3 fused
checkpoints and a partial rotary, Mixtral and Qwen3-MoE a mixture of experts).

A layer: RMSNorm, attention (fused q/k/v projection, optional per-head q/k RMSNorm, rotary,
paged attention, output projection), residual add, RMSNorm, MLP, residual add; the residual add
is fused into the next norm. The forward pass takes the tokens of many sequences back to back
(no padding), their positions, and explicit attention metadata; the KV cache pools are bound to
the attention layers once, by the worker.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention import AttentionBackend, AttentionMetadata
from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.decoder import DecoderForCausalLM, build_attention
from pagedllm.model.layers import QKVParallelLinear, RMSNorm, RowParallelLinear, VocabParallelEmbedding
from pagedllm.model.mlp import GatedMLP
from pagedllm.model.moe import SparseMoE, expert_checkpoint_targets
from pagedllm.model.rotary import RotaryEmbedding
from pagedllm.model.weights import LazyWeight
from pagedllm.transformers_utils.arch import ModelArchConfig


class LlamaAttention(nn.Module):
    """Also Gemma's (with its own norm class for the q/k heads, and Gemma 2's soft-cap)."""

    def __init__(self, cfg: ModelArchConfig, layer: int, rotary: RotaryEmbedding, backend: AttentionBackend, tp, dtype,
                 head_norm: type = RMSNorm):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias, tp, dtype
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.attention_out_bias, tp, dtype)
        self.head_dim = cfg.head_dim
        # Qwen3, Gemma 3: a norm over each query and key head, before the rotary.
        self.q_norm = head_norm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = head_norm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.rotary = rotary
        self.attn = build_attention(cfg, layer, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, backend,
                                    logits_soft_cap=cfg.attn_logit_softcapping)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [num_tokens, (heads + 2 * kv_heads) * head_dim]
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        if self.q_norm is not None:
            for norm, start, size in ((self.q_norm, 0, q_size), (self.k_norm, q_size, kv_size)):
                heads = qkv[:, start : start + size]
                heads.copy_(norm(heads.reshape(-1, self.head_dim)).view(heads.shape))
        self.rotary(positions, qkv[:, : q_size + kv_size])  # queries and keys, in place
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, metadata))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer: int, rotary, backend, tp, dtype, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, layer, rotary, backend, tp, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = mlp

    def forward(self, positions, hidden, residual, metadata):
        """hidden: the previous layer's output, not yet added to `residual` (the residual
        stream); for the first layer, the embeddings, with residual None. Returns this layer's
        (output, residual) in the same form."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    decoder_layer = LlamaDecoderLayer  # (Granite's scales its residual branches)

    def __init__(self, cfg: ModelArchConfig, max_position: int, backend, tp, dtype, make_mlp):
        super().__init__()
        self.rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, dtype,
                                      cfg.partial_rotary_factor)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(
            self.decoder_layer(cfg, layer, self.rotary, backend, tp, dtype, make_mlp(layer))
            for layer in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # The layer loop as one C++ call where it applies (pagedllm.model.fused_layers; set by the
        # worker).
        self.fused_layers = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, metadata):
        if self.fused_layers is not None and self.fused_layers.applies(input_ids, metadata):
            return self.fused_layers(positions, input_ids, metadata)  # (the lookup and final norm included)
        hidden = self.embed(input_ids)
        positions = self.rotary.table_positions(positions, metadata)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(DecoderForCausalLM):
    """Serves `LlamaForCausalLM`, `MistralForCausalLM` and `Qwen2ForCausalLM` checkpoints; the base
    of the other Llama-shaped families, which override `make_mlp` and the checkpoint names."""

    def build_model(self, max_position, backend, tp, dtype) -> LlamaModel:
        return LlamaModel(self.cfg, max_position, backend, tp, dtype, lambda layer: self.make_mlp(layer, tp, dtype))

    def make_mlp(self, layer: int, tp: TensorParallelGroup, dtype: torch.dtype) -> nn.Module:
        """Layer `layer`'s MLP: the mixture of experts where the model has one there."""
        cfg = self.cfg
        if cfg.is_moe_layer(layer):
            return SparseMoE(cfg.hidden_size, cfg.moe, cfg.hidden_act, tp, dtype)
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias, tp, dtype)

    def checkpoint_targets(self, name: str, weight: LazyWeight):
        if self.cfg.moe is not None:
            experts = expert_checkpoint_targets(name, weight)
            if experts is not None:
                yield from experts
                return
        yield from super().checkpoint_targets(name, weight)

    def layer_projections(self, layer: int) -> dict[str, nn.Parameter]:
        block = self.model.layers[layer]
        weights = {"qkv_proj": block.self_attn.qkv_proj.weight, "o_proj": block.self_attn.o_proj.weight}
        mlp = block.mlp
        if isinstance(mlp, GatedMLP):
            weights.update(gate_up_proj=mlp.gate_up_proj.weight, down_proj=mlp.down_proj.weight)
        else:  # a mixture of experts: the router, and the experts' stacked weights
            weights.update(router=mlp.gate.weight, experts_gate_up_proj=mlp.experts.gate_up_proj,
                           experts_down_proj=mlp.experts.down_proj)
        return weights

    def fused_decoder_plan(self):
        """Llama-shaped layers (q/k head norms, a partial or LongRoPE rotary, Granite's branch
        multiplier included) with a dense MLP or a mixture of experts, on one rank: what the C++
        layer loop computes (quantized projections, experts and the activation are checked by the
        caller)."""
        from pagedllm.model.fused_layers import FusedDecoderPlan, FusedLayer, norm_weight

        cfg = self.cfg
        if self.tp.size != 1:
            return None
        layers = []
        for block in self.model.layers:
            attn, mlp = block.self_attn, block.mlp
            heads = {}
            if attn.q_norm is not None:
                heads = dict(q_norm=norm_weight(attn.q_norm), k_norm=norm_weight(attn.k_norm))
            if isinstance(mlp, GatedMLP):
                mlp_parts = dict(gate_up=mlp.gate_up_proj, down=mlp.down_proj, activation=mlp.hidden_act)
            else:  # a mixture of experts
                mlp_parts = dict(gate_up=None, down=None, activation=mlp.experts.hidden_act, moe=mlp)
            layers.append(FusedLayer(
                norm_weight(block.input_layernorm), norm_weight(block.post_attention_layernorm), attn.qkv_proj,
                attn.o_proj, attn=attn.attn, rotary=attn.rotary, **mlp_parts,
                branch_scale=getattr(block, "residual_multiplier", 1.0), **heads))
        # (Granite's embedding multiplier: what its `embed` multiplies by, the fused call too)
        return FusedDecoderPlan(layers, cfg.rms_norm_eps, norm_weight(self.model.norm), self.model.embed_tokens,
                                embed_scale=getattr(self.model, "embedding_multiplier", 1.0))
