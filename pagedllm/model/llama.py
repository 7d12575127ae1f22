"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat batch of tokens and a paged KV cache.

The forward pass takes the tokens of many sequences back to back (no padding), their
positions, and explicit attention metadata; the KV cache pools are bound to the attention
layers once, by the worker.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention import Attention, AttentionBackend, AttentionMetadata
from pagedllm.distributed import TensorParallelGroup
from pagedllm.kv_spec import AttentionSpec
from pagedllm.kernels import ops as fused_ops
from pagedllm.transformers_utils.arch import ModelArchConfig
from pagedllm.model.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)
from pagedllm.model.rotary import RotaryEmbedding
from pagedllm.model.weights import LazyWeight


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer: int, rotary: RotaryEmbedding, backend: AttentionBackend, tp, dtype):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias, tp, dtype
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, False, tp, dtype)
        self.rotary = rotary
        self.attn = Attention(
            self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5, backend,
            sliding_window=cfg.layer_sliding_window(layer),
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [num_tokens, (heads + 2 * kv_heads) * head_dim]
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.rotary(positions, qkv[:, : q_size + kv_size])  # queries and keys, in place
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, metadata))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig, tp, dtype):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size, cfg.intermediate_size], False, tp, dtype
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused_ops.applies_to_layer(gate_up):
            return self.down_proj(fused_ops.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer: int, rotary, backend, tp, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, layer, rotary, backend, tp, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, tp, dtype)

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
    def __init__(self, cfg: ModelArchConfig, max_position: int, backend, tp, dtype):
        super().__init__()
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, layer, rotary, backend, tp, dtype) for layer in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # The layer loop as one C++ call where it applies (pagedllm.model.fused_layers; set by the
        # worker).
        self.fused_layers = None

    def forward(self, input_ids, positions, metadata):
        hidden = self.embed_tokens(input_ids)
        if self.fused_layers is not None and self.fused_layers.applies(hidden, metadata):
            hidden, residual = self.fused_layers(positions, hidden, metadata)
        else:
            residual = None
            for layer in self.layers:
                hidden, residual = layer(positions, hidden, residual, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


# Checkpoint projections that we fuse: (our parameter, checkpoint name, shard id).
_STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class LlamaForCausalLM(nn.Module):
    """Serves `LlamaForCausalLM`, `MistralForCausalLM` and `Qwen2ForCausalLM` checkpoints."""

    def __init__(
        self,
        cfg: ModelArchConfig,
        max_position: int,
        backend: AttentionBackend,
        tp: TensorParallelGroup = TensorParallelGroup(),
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.model = LlamaModel(cfg, max_position, backend, tp, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def kv_cache_spec(self) -> list[AttentionSpec]:
        """What each layer stores in the KV cache on this rank (one entry per layer)."""
        return [
            AttentionSpec(attn.num_kv_heads, attn.head_dim, attn.sliding_window) for attn in self.attention_layers
        ]

    def bind_kv_cache(
        self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], kv_cache_groups: list[int] | None = None
    ) -> None:
        """Give each attention layer its key and value block pools, and the KV cache group whose
        block tables address them (`kv_spec.kv_cache_groups`; all 0 by default)."""
        groups = kv_cache_groups or [0] * len(key_caches)
        for attn, k, v, group in zip(self.attention_layers, key_caches, value_caches, groups, strict=True):
            attn.key_cache, attn.value_cache, attn.kv_cache_group = k, v, group

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [n, hidden_size] -> logits [n, vocab_size] on rank 0 (None on other ranks)."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, LazyWeight]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, weight in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            for fused, original, shard_id in _STACKED_PARAMS:
                if f".{original}." in name:
                    name = name.replace(original, fused)
                    param = params[name]
                    param.weight_loader(param, weight, shard_id)
                    loaded.add(f"{name}:{shard_id}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {self.cfg.architecture}")
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, weight)
                loaded.add(name)
        expected = set()
        for name in params:
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            for fused, _, shard_id in _STACKED_PARAMS:
                if f".{fused}." in name:
                    expected.add(f"{name}:{shard_id}")
            if not any(f".{fused}." in name for fused, _, _ in _STACKED_PARAMS):
                expected.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:5]}")
