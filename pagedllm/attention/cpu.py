"""The fast CPU PagedAttention backend.

Decode tokens, and prompt tokens that extend a cached context (prefix-cache hits, chunked
prefill), go through the C++ kernel, which reads keys and values in place through the block
tables, parallel over sequences and KV heads, with grouped-query attention computed per KV head
(no repeated heads). A prompt with no cached context attends only to its own fresh keys and
values, so it uses torch's fused causal attention on them directly.

Sliding windows and logit soft-caps are the kernel's own (a windowed query reads no block before
its window). A fresh prompt longer than its layer's window goes through the kernel too, which
reads only each tile's window: 3-40x faster than fused attention with the window as a mask
(2 cores, 9 heads of 64, prompts of 256-4096 tokens, windows of 128-4096), and so does every
fresh prompt of a soft-capped layer (fused attention has no soft-cap). A window at least as long
as the prompt changes nothing: it takes fused causal attention as without one.

In batch-invariant mode (`batch_invariant=True`) a token's attention is computed in one fixed
order whatever shares its step: every token goes through the kernel (fresh prompts included),
and contexts are cut into partitions of a fixed size from their start, merged in order, instead
of into as many partitions as keep the threads busy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.kernels import build as cpu_kernels
from pagedllm.kernels import ops
from pagedllm.kernels.ops import as_kernel_array
from pagedllm.utils import cdiv

# Prompt tokens handled by one work item of the kernel: its keys and values are read once for
# all of them.
TILE_TOKENS = 16
# In batch-invariant mode every context is cut into partitions of this many keys (rounded up to
# whole blocks) from its start, whatever the batch holds, and merged in order.
INVARIANT_PARTITION_TOKENS = 256

# (compute dtype, KV cache dtype) -> the kernel's type suffix.
_KERNELS = {
    (torch.float32, torch.float32): "f32_f32",
    (torch.bfloat16, torch.bfloat16): "bf16_bf16",
    (torch.float32, torch.bfloat16): "f32_bf16",
}


def supports(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    return (dtype, cache_dtype) in _KERNELS


@dataclass
class _Plan:
    """How one step's batch splits between the kernel and fused attention (built once per step,
    shared by every layer)."""

    item_seq: torch.Tensor  # int32 [num_items]
    item_first_token: torch.Tensor  # int32 [num_items]
    item_num_tokens: torch.Tensor  # int32 [num_items]
    token_context: torch.Tensor  # int64 [num_tokens]: keys visible to each token
    block_tables: torch.Tensor  # int32, contiguous
    fresh_prompts: list[tuple[int, int]]  # (first token, length) of prompts without cached context
    # The layers the plan is for: a window (tokens) and whether scores are soft-capped.
    sliding_window: int | None = None
    soft_capped: bool = False


def _plan(metadata: AttentionMetadata, batch_invariant: bool, sliding_window: int | None = None,
          soft_capped: bool = False) -> _Plan:
    if metadata.num_decodes == len(metadata.query_lens):  # decodes only (the common step)
        return _decode_plan(metadata, sliding_window, soft_capped)
    query_lens = np.asarray(metadata.query_lens, dtype=np.int64)
    seq_lens = np.asarray(metadata.seq_lens_list, dtype=np.int64)
    starts = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=starts[1:])
    # Each token sees the context up to and including itself.
    offsets = np.arange(int(starts[-1])) - np.repeat(starts[:-1], query_lens)
    token_context = np.repeat(seq_lens - query_lens, query_lens) + offsets + 1
    # Batch-invariant: every token through the kernel, whose sums run in the same order for a
    # token whether it comes alone (decode), in a tile of a prompt, or in a prompt with no context.
    fresh = (query_lens > 1) & (seq_lens == query_lens) & (not batch_invariant) & (not soft_capped)
    if sliding_window is not None:
        fresh &= seq_lens <= sliding_window  # the window cuts nothing: fused causal attention
    # Decodes are one-token items; other non-fresh sequences are cut into tiles.
    tiles = np.where(fresh, 0, cdiv(query_lens, TILE_TOKENS))
    item_seq = np.repeat(np.arange(len(query_lens)), tiles)
    tile_index = np.arange(int(tiles.sum())) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    item_first = starts[item_seq] + tile_index * TILE_TOKENS
    item_count = np.minimum(TILE_TOKENS, query_lens[item_seq] - tile_index * TILE_TOKENS)
    return _Plan(
        item_seq=torch.from_numpy(item_seq.astype(np.int32)),
        item_first_token=torch.from_numpy(item_first.astype(np.int32)),
        item_num_tokens=torch.from_numpy(item_count.astype(np.int32)),
        token_context=torch.from_numpy(token_context),
        block_tables=as_kernel_array(metadata.block_tables, torch.int32),
        fresh_prompts=[(int(starts[i]), int(query_lens[i])) for i in np.flatnonzero(fresh)],
        sliding_window=sliding_window,
        soft_capped=soft_capped,
    )


def _decode_plan(metadata: AttentionMetadata, sliding_window: int | None, soft_capped: bool) -> _Plan:
    """`_plan` of a step of decodes only: one item of one token per sequence, no fresh prompt."""
    seqs, ones = _decode_items(metadata.num_decodes)
    return _Plan(item_seq=seqs, item_first_token=seqs, item_num_tokens=ones,
                 token_context=as_kernel_array(metadata.seq_lens, torch.int64),
                 block_tables=as_kernel_array(metadata.block_tables, torch.int32), fresh_prompts=[],
                 sliding_window=sliding_window, soft_capped=soft_capped)


def decode_inputs_advancer():
    """The C function that moves a CPU decode step's inputs (positions, context lengths, slots,
    input ids) one token further in place (`worker.decode_inputs`), or None where the kernel
    library is not built."""
    return ops.entry("advance_decode_inputs")


@functools.lru_cache(maxsize=64)
def _decode_items(num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode plan's item arrays (0, 1, ..., and ones), the same every step of that many
    sequences: kept, never written (the kernels only read them)."""
    seqs = torch.arange(num_seqs, dtype=torch.int32)
    return seqs, torch.ones_like(seqs)


class CPUAttentionBackend(AttentionBackend):
    """Pools are [num_blocks, num_kv_heads, block_size, head_dim]: a block's KV heads lie side by
    side, so the kernel reads each block as one contiguous run, and a sequence whose blocks have
    consecutive ids (as the free queue tends to hand them out) as one long stream."""

    name = "cpu"

    def __init__(self, batch_invariant: bool = False) -> None:
        self.lib = cpu_kernels.load()
        self.batch_invariant = batch_invariant

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, head_dim)

    def _kernels(self, dtype: torch.dtype, cache_dtype: torch.dtype):
        types = _KERNELS.get((dtype, cache_dtype))
        if types is None:
            raise ValueError(
                f"The cpu attention backend supports float32 and bfloat16 (and a bfloat16 cache for a float32 "
                f"model), not {dtype} with a {cache_dtype} cache; use the reference backend."
            )
        return getattr(self.lib, f"paged_attention_{types}"), getattr(self.lib, f"write_kv_{types}")

    def _windowed_kernel(self, dtype: torch.dtype, cache_dtype: torch.dtype):
        """The attention entry point that also takes a window and a soft-cap."""
        self._kernels(dtype, cache_dtype)  # (the error for an unsupported pair)
        return getattr(self.lib, f"paged_attention_{_KERNELS[(dtype, cache_dtype)]}_windowed")

    def write_kv(self, key, value, key_cache, value_cache, metadata: AttentionMetadata) -> None:
        _, write = self._kernels(key.dtype, key_cache.dtype)
        key, value = key.contiguous(), value.contiguous()
        _, num_kv_heads, block_size, head_dim = key_cache.shape
        slots = metadata.slot_mapping
        write(key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
              key_cache.stride(0), key_cache.stride(1), slots.data_ptr(), slots.shape[0], num_kv_heads, head_dim, block_size)

    def plan(self, metadata: AttentionMetadata, sliding_window: int | None = None,
             logits_soft_cap: float | None = None) -> _Plan:
        """The step's plan for layers of this window and soft-cap, built by the first layer and
        kept in `metadata` for the others (`metadata` is one KV cache group's, whose layers share
        their window, so their plans agree)."""
        soft_capped = logits_soft_cap is not None
        plan = metadata.backend_plan
        if plan is None or plan.sliding_window != sliding_window or plan.soft_capped != soft_capped:
            plan = metadata.backend_plan = _plan(metadata, self.batch_invariant, sliding_window, soft_capped)
        return plan

    def forward(self, query, key, value, key_cache, value_cache, metadata: AttentionMetadata, scale: float,
                sliding_window: int | None = None, logits_soft_cap: float | None = None):
        plan = self.plan(metadata, sliding_window, logits_soft_cap)
        attention, _ = self._kernels(query.dtype, key_cache.dtype)
        query = query.contiguous()
        out = torch.empty_like(query)
        num_heads = query.shape[1]
        _, num_kv_heads, block_size, head_dim = key_cache.shape
        num_items = plan.item_seq.shape[0]
        fixed_partition_blocks = cdiv(INVARIANT_PARTITION_TOKENS, block_size) if self.batch_invariant else 0
        if num_items:
            args = (
                out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                key_cache.stride(0), key_cache.stride(1), plan.block_tables.data_ptr(), plan.block_tables.shape[1],
                plan.item_seq.data_ptr(), plan.item_first_token.data_ptr(), plan.item_num_tokens.data_ptr(), num_items,
                plan.token_context.data_ptr(), num_heads, num_kv_heads, head_dim, block_size, scale,
                fixed_partition_blocks,
            )
            if sliding_window is None and logits_soft_cap is None:  # the shorter call (ctypes: ~0.1 us an argument)
                attention(*args, torch.get_num_threads())
            else:
                self._windowed_kernel(query.dtype, key_cache.dtype)(
                    *args, sliding_window or 0, logits_soft_cap or 0.0, torch.get_num_threads()
                )
        if plan.fresh_prompts and key_cache.dtype != key.dtype:
            # Use the keys and values as the cache holds them, as later steps will see them.
            key, value = key.to(key_cache.dtype).to(key.dtype), value.to(key_cache.dtype).to(value.dtype)
        for first, length in plan.fresh_prompts:
            # q: [1, heads, length, head_dim]; k, v: [1, kv_heads, length, head_dim]. The math is in
            # float32 whatever the model's dtype, as in the kernel: bfloat16 softmax sums drift.
            q = query[first : first + length].transpose(0, 1).unsqueeze(0).float()
            k = key[first : first + length].transpose(0, 1).unsqueeze(0).float()
            v = value[first : first + length].transpose(0, 1).unsqueeze(0).float()
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=num_heads != num_kv_heads)
            out[first : first + length] = o.squeeze(0).transpose(0, 1).to(out.dtype)
        return out

