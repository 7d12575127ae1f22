"""The attention layer of a model: writes this step's keys and values into its layer's block
pools and lets the backend compute attention through the block tables."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        backend: AttentionBackend,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        self.sliding_window = sliding_window  # tokens each query sees, itself included; None: all
        self.logits_soft_cap = logits_soft_cap
        # The KV cache group whose block tables address this layer's pools (`kv_spec`).
        self.kv_cache_group = 0
        # This layer's pools; bound once by the worker's cache engine (`bind_kv_cache`).
        self.key_cache: torch.Tensor | None = None
        self.value_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        if self.key_cache is None or self.value_cache is None:
            raise RuntimeError("Attention layer has no KV cache bound; call model.bind_kv_cache() first.")
        if self.kv_cache_group:  # a hybrid model's other groups have block tables of their own
            metadata = metadata.for_group(self.kv_cache_group)
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        self.backend.write_kv(k, v, self.key_cache, self.value_cache, metadata)
        if self.sliding_window is None and self.logits_soft_cap is None:
            out = self.backend.forward(q, k, v, self.key_cache, self.value_cache, metadata, self.scale)
        else:
            out = self.backend.forward(q, k, v, self.key_cache, self.value_cache, metadata, self.scale,
                                       self.sliding_window, self.logits_soft_cap)
        return out.view(num_tokens, self.num_heads * self.head_dim)
