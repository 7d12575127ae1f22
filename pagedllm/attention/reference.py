"""Reference PagedAttention in plain torch: the oracle the faster backends are checked against.

For each sequence it gathers the context's blocks named by the block table into a temporary
tensor and runs causal attention over it in float32. Clear rather than fast.
"""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.kv_spec import first_block_in_window
from pagedllm.utils import cdiv


class ReferenceAttentionBackend(AttentionBackend):
    name = "reference"

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def write_kv(self, key, value, key_cache, value_cache, metadata: AttentionMetadata) -> None:
        num_kv_heads, head_dim = key_cache.shape[-2:]
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, key.to(key_cache.dtype))
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, value.to(value_cache.dtype))

    def forward(self, query, key, value, key_cache, value_cache, metadata: AttentionMetadata, scale: float,
                sliding_window: int | None = None, logits_soft_cap: float | None = None):
        return paged_attention_torch(query, key_cache, value_cache, metadata, scale, sliding_window, logits_soft_cap)


def paged_attention_torch(query, key_cache, value_cache, metadata: AttentionMetadata, scale: float,
                          sliding_window: int | None, logits_soft_cap: float | None) -> torch.Tensor:
    """Attention of every query token over its sequence's paged context, in float32, one
    sequence at a time. Pools are [num_blocks, block_size, kv_heads, head_dim]."""
    num_heads = query.shape[1]
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = metadata.query_start_loc.tolist()
    for i, (q_len, ctx_len) in enumerate(zip(metadata.query_lens, metadata.seq_lens_list)):
        # The blocks from the one holding the first query's first visible key: those before it
        # may have left a sliding window and been reused (their table entries are placeholders).
        first = first_block_in_window(sliding_window, ctx_len - q_len, block_size)
        blocks = metadata.block_tables[i, first : cdiv(ctx_len, block_size)].long()
        k, v = key_cache[blocks], value_cache[blocks]
        # k, v: [keys from the first block on, num_kv_heads, head_dim], gathered from the block pool
        num_keys = ctx_len - first * block_size
        k = k.reshape(-1, num_kv_heads, head_dim)[:num_keys].float().repeat_interleave(group, dim=1)
        v = v.reshape(-1, num_kv_heads, head_dim)[:num_keys].float().repeat_interleave(group, dim=1)
        q = query[starts[i] : starts[i] + q_len].float()  # [q_len, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        # Query j sits at position ctx_len - q_len + j and sees keys up to that position (and,
        # with a window, none `sliding_window` or more positions back).
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(first * block_size, ctx_len, device=query.device).unsqueeze(0)
        visible = k_pos <= q_pos  # [q_len, ctx_len]
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[starts[i] : starts[i] + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
