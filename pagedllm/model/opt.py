"""OPT (the PagedAttention paper's own models): learned positional embeddings looked up at
position + 2, LayerNorms, ReLU MLP (fc1, fc2), biases on every projection, multi-head attention
with the query scaled after its projection (and the scores not again), and:

- do_layer_norm_before (OPT-125m, 1.3B and up): each block norms its input (pre-norm) and the
  decoder ends with a final LayerNorm; False (OPT-350m): each block norms its output instead;
- word_embed_proj_dim != hidden_size (OPT-350m): embeddings narrower than the layers, widened by
  project_in and narrowed back by project_out before the (tied) LM head.

Checkpoints name everything under `model.decoder.` (or `decoder.`). llama.cpp has no OPT
converter, so there is no GGUF form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention import AttentionBackend, AttentionMetadata
from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.activations import activation
from pagedllm.model.decoder import DecoderForCausalLM, build_attention
from pagedllm.model.layers import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    _new_param,
    default_weight_loader,
)
from pagedllm.model.norms import LayerNorm
from pagedllm.model.weights import LazyWeight
from pagedllm.transformers_utils.arch import ModelArchConfig

# OPT's learned positions start at row 2 of the table (its padding-offset convention).
POSITION_OFFSET = 2


class OPTAttention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer: int, backend: AttentionBackend, tp, dtype):
        super().__init__()
        hidden = cfg.hidden_size
        self.qkv_proj = QKVParallelLinear(hidden, cfg.head_dim, cfg.num_heads, cfg.num_heads, cfg.attention_bias, tp, dtype)
        self.out_proj = RowParallelLinear(hidden, hidden, cfg.attention_out_bias, tp, dtype)
        self.scaling = cfg.head_dim**-0.5
        self.attn = build_attention(cfg, layer, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, backend, scale=1.0)

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        return self.out_proj(self.attn(q * self.scaling, k, v, metadata))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer: int, backend, tp, dtype):
        super().__init__()
        hidden, affine = cfg.hidden_size, cfg.layer_norm_elementwise_affine
        self.norm_before = cfg.do_layer_norm_before
        self.self_attn = OPTAttention(cfg, layer, backend, tp, dtype)
        self.self_attn_layer_norm = LayerNorm(hidden, cfg.rms_norm_eps, affine, dtype)
        self.fc1 = ColumnParallelLinear(hidden, cfg.intermediate_size, cfg.mlp_bias, tp, dtype)
        self.fc2 = RowParallelLinear(cfg.intermediate_size, hidden, cfg.mlp_bias, tp, dtype)
        self.final_layer_norm = LayerNorm(hidden, cfg.rms_norm_eps, affine, dtype)
        self.act = activation(cfg.hidden_act)

    def forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        residual = hidden
        if self.norm_before:
            hidden = self.self_attn_layer_norm(hidden)
        hidden = residual + self.self_attn(hidden, metadata)
        if not self.norm_before:
            hidden = self.self_attn_layer_norm(hidden)
        residual = hidden
        if self.norm_before:
            hidden = self.final_layer_norm(hidden)
        hidden = residual + self.fc2(self.act(self.fc1(hidden)))
        if not self.norm_before:
            hidden = self.final_layer_norm(hidden)
        return hidden


class LearnedPositions(nn.Module):
    """The positional embedding table [max_position_embeddings + 2, hidden], replicated."""

    def __init__(self, num_positions: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _new_param(num_positions + POSITION_OFFSET, hidden_size, dtype=dtype, loader=default_weight_loader)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + POSITION_OFFSET, self.weight)


class OPTDecoder(nn.Module):
    def __init__(self, cfg: ModelArchConfig, backend, tp, dtype):
        super().__init__()
        hidden, width = cfg.hidden_size, cfg.word_embed_proj_dim or cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, width, tp, dtype)
        self.embed_positions = LearnedPositions(cfg.max_position_embeddings, hidden, dtype)
        replicated = TensorParallelGroup()  # small: every rank holds the whole projection
        self.project_in = ColumnParallelLinear(width, hidden, False, replicated, dtype) if width != hidden else None
        self.project_out = ColumnParallelLinear(hidden, width, False, replicated, dtype) if width != hidden else None
        self.final_layer_norm = (
            LayerNorm(hidden, cfg.rms_norm_eps, cfg.layer_norm_elementwise_affine, dtype) if cfg.final_layer_norm else None
        )
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg, layer, backend, tp, dtype) for layer in range(cfg.num_layers))

    def forward(self, input_ids, positions, metadata):
        embeds = self.embed_tokens(input_ids)
        if self.project_in is not None:
            embeds = self.project_in(embeds)
        hidden = embeds + self.embed_positions(positions)
        for layer in self.layers:
            hidden = layer(hidden, metadata)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        return self.project_out(hidden) if self.project_out is not None else hidden


class OPTModel(nn.Module):
    def __init__(self, cfg: ModelArchConfig, backend, tp, dtype):
        super().__init__()
        self.decoder = OPTDecoder(cfg, backend, tp, dtype)

    def forward(self, input_ids, positions, metadata):
        return self.decoder(input_ids, positions, metadata)


class OPTForCausalLM(DecoderForCausalLM):
    stacked_params = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"))

    def build_model(self, max_position, backend, tp, dtype) -> OPTModel:
        return OPTModel(self.cfg, backend, tp, dtype)

    @property
    def embedding_weight(self) -> nn.Parameter:
        return self.model.decoder.embed_tokens.weight

    def layer_projections(self, layer: int) -> dict[str, nn.Parameter]:
        block = self.model.decoder.layers[layer]
        return {"qkv_proj": block.self_attn.qkv_proj.weight, "out_proj": block.self_attn.out_proj.weight,
                "fc1": block.fc1.weight, "fc2": block.fc2.weight}

    def checkpoint_targets(self, name: str, weight: LazyWeight):
        if name.startswith("decoder."):  # saved from OPTModel rather than OPTForCausalLM
            name = f"model.{name}"
        yield from super().checkpoint_targets(name, weight)

    @classmethod
    def gguf_to_hf_name(cls, name: str) -> str:
        raise ValueError("OPT has no GGUF form (llama.cpp has no OPT converter); load its Hugging Face folder.")
