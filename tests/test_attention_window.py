"""Sliding windows and logit soft-capping in every attention backend, against a dense oracle:
each sequence's whole context attended at once with an explicit mask, in float64.

One batch mixes what a step holds: a decode of a one-token context, decodes over longer ones, a
chunk extending a cached context, a fresh prompt, and a long decode whose context the CPU kernel
splits into partitions. Windows are shorter than a block, longer than blocks and shorter than
the contexts, and longer than every context. The block-table entries wholly before each
sequence's window point to a block of NaNs, as after the block manager gave them back to the
pool: a kernel that read one of them, even with zero weight, would turn its output into NaN.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedllm.attention import AttentionMetadata
from pagedllm.attention.cpu import CPUAttentionBackend
from pagedllm.attention.reference import ReferenceAttentionBackend
from pagedllm.kv_spec import first_block_in_window

QUERY_LENS = [1, 1, 9, 20, 1]
CONTEXT_LENS = [1, 50, 30, 20, 600]
NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 3, 32  # grouped-query attention: 3 query heads per KV head
WINDOWS = [1, 7, 16, 40, 1000]


def _dense(query, keys, values, query_lens, context_lens, scale, window, cap):
    """Attention of each query over its sequence's contiguous keys, masked by hand."""
    out, q_start, k_start = [], 0, 0
    group = query.shape[1] // keys.shape[1]
    for q_len, ctx in zip(query_lens, context_lens):
        q = query[q_start : q_start + q_len].double()
        k = keys[k_start : k_start + ctx].double().repeat_interleave(group, dim=1)
        v = values[k_start : k_start + ctx].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        for j in range(q_len):
            p = ctx - q_len + j
            for key_pos in range(ctx):
                if key_pos > p or (window is not None and p - key_pos >= window):
                    scores[:, j, key_pos] = -math.inf
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        q_start, k_start = q_start + q_len, k_start + ctx
    return torch.cat(out)


def random_sequences(query_lens, context_lens, seed=0, dtype=torch.float32):
    """(queries [q_len, heads, head_dim], keys and values [context, kv_heads, head_dim]) of each
    sequence; its queries are its last q_len positions."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            (torch.randn(q_len, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen) * 2).to(dtype),
            torch.randn(ctx, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
            torch.randn(ctx, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype),
        )
        for q_len, ctx in zip(query_lens, context_lens)
    ]


class Case:
    """A batch of sequences, its paged cache in a backend's layout (context blocks scattered over
    the pool, the entries before each window pointing at a block of NaNs) and its metadata."""

    def __init__(self, backend, block_size, window, sequences, device="cpu", seed=0):
        self.query = torch.cat([q for q, _, _ in sequences])
        self.keys = torch.cat([k for _, k, _ in sequences])
        self.values = torch.cat([v for _, _, v in sequences])
        self.query_lens = [q.shape[0] for q, _, _ in sequences]
        self.context_lens = [k.shape[0] for _, k, _ in sequences]
        num_blocks = sum(-(-c // block_size) for c in self.context_lens) + 1
        poison = num_blocks - 1
        free = list(np.random.default_rng(seed).permutation(poison))
        # reference layout [blocks, block_size, kv_heads, head_dim]; filled, then transposed
        key_cache = torch.zeros(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype=self.keys.dtype)
        value_cache = torch.zeros_like(key_cache)
        key_cache[poison] = value_cache[poison] = float("nan")
        tables, slots = [], []
        for (q, k, v), q_len, ctx in zip(sequences, self.query_lens, self.context_lens):
            table = [int(free.pop()) for _ in range(-(-ctx // block_size))]
            for p in range(ctx):
                key_cache[table[p // block_size], p % block_size] = k[p]
                value_cache[table[p // block_size], p % block_size] = v[p]
            slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - q_len, ctx)]
            gone = first_block_in_window(window, ctx - q_len, block_size)
            tables.append([poison] * gone + table[gone:])
        if backend.kv_cache_shape(1, block_size, NUM_KV_HEADS, HEAD_DIM)[1] == NUM_KV_HEADS:  # heads first
            key_cache, value_cache = key_cache.transpose(1, 2).contiguous(), value_cache.transpose(1, 2).contiguous()
        self.key_cache, self.value_cache = key_cache.to(device), value_cache.to(device)
        block_tables = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int32)
        for i, table in enumerate(tables):
            block_tables[i, : len(table)] = torch.tensor(table)
        self.metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.from_numpy(np.concatenate([[0], np.cumsum(self.query_lens)])).to(device),
            seq_lens=torch.tensor(self.context_lens, device=device),
            block_tables=block_tables.to(device),
            query_lens=self.query_lens,
            seq_lens_list=self.context_lens,
            block_size=block_size,
            num_decodes=next((i for i, q in enumerate(self.query_lens) if q != 1), len(self.query_lens)),
        )
        ends = np.cumsum(self.context_lens)
        self.fresh = torch.cat([torch.arange(e - q, e) for e, q in zip(ends, self.query_lens)])
        self.device = device

    def run(self, backend, window, cap):
        """The backend's output, as float64 on the CPU."""
        to = dict(device=self.device)
        out = backend.forward(self.query.to(**to), self.keys[self.fresh].to(**to), self.values[self.fresh].to(**to),
                              self.key_cache, self.value_cache, self.metadata, HEAD_DIM**-0.5,
                              sliding_window=window, logits_soft_cap=cap)
        return out.double().cpu()

    def dense(self, window, cap):
        return _dense(self.query.float(), self.keys.float(), self.values.float(), self.query_lens, self.context_lens,
                      HEAD_DIM**-0.5, window, cap)


def mixed_case(backend, block_size, window, device="cpu", dtype=torch.float32):
    return Case(backend, block_size, window, random_sequences(QUERY_LENS, CONTEXT_LENS, dtype=dtype), device)


BACKENDS = {
    "reference": ReferenceAttentionBackend,
    "cpu": CPUAttentionBackend,
    "cpu-batch-invariant": lambda: CPUAttentionBackend(batch_invariant=True),
}


@pytest.mark.parametrize("cap", [None, 2.0])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_windowed_and_capped_attention_matches_a_dense_mask(name, block_size, window, cap):
    backend = BACKENDS[name]()
    case = mixed_case(backend, block_size, window)
    want = case.dense(window, cap)
    torch.testing.assert_close(case.run(backend, window, cap), want, atol=2e-5, rtol=0)
    if window < 40:  # the window really cut something: full attention differs
        assert not torch.allclose(case.dense(None, cap), want, atol=1e-3)


@pytest.mark.parametrize("window, cap", [(7, None), (40, 2.0)])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
def test_windowed_attention_in_bfloat16_matches_a_dense_mask(window, cap, cache_dtype):
    """bfloat16 queries and cache (and a bfloat16 cache under a float32 model): the dense
    oracle on the same rounded inputs, within bfloat16's output rounding."""
    backend = CPUAttentionBackend()
    dtype = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32
    case = mixed_case(backend, 16, window, dtype=torch.bfloat16)
    case.query = case.query.to(dtype)
    case.key_cache, case.value_cache = case.key_cache.to(cache_dtype), case.value_cache.to(cache_dtype)
    torch.testing.assert_close(case.run(backend, window, cap), case.dense(window, cap), atol=1e-2, rtol=2**-7)


@pytest.mark.parametrize("window", [40, 300])
def test_batch_invariant_windowed_tokens_are_the_same_bits_alone_batched_or_in_a_chunk(window):
    """In batch-invariant mode a windowed token's partitions stay at fixed places from block 0,
    so the long decode gives the same bits alone, in the mixed batch, and as the last token of a
    prompt chunk ending at its position."""
    backend = CPUAttentionBackend(batch_invariant=True)
    sequences = random_sequences(QUERY_LENS, CONTEXT_LENS)
    query, keys, values = sequences[-1]  # the decode at position 599
    batched = Case(backend, 16, window, sequences).run(backend, window, None)[-1]
    alone = Case(backend, 16, window, [(query, keys, values)]).run(backend, window, None)[-1]
    chunk = torch.cat([torch.randn(6, *query.shape[1:]), query])  # positions 593..599
    in_chunk = Case(backend, 16, window, [(chunk, keys, values)]).run(backend, window, None)[-1]
    assert torch.equal(alone, batched) and torch.equal(alone, in_chunk)


# --- Triton (its interpreter on a CPU; compiled on a GPU) -----------------------------------------


@pytest.mark.parametrize(
    "block_size, window, cap",
    [(16, 7, None), (16, 40, None), (16, 1000, 2.0), (32, 40, 2.0), (32, 1, None)],
)
def test_triton_windowed_and_capped_attention_matches_a_dense_mask(triton_device, block_size, window, cap):
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(triton_device)
    case = mixed_case(backend, block_size, window, triton_device)
    torch.testing.assert_close(case.run(backend, window, cap), case.dense(window, cap), atol=2e-5, rtol=0)


@pytest.mark.parametrize("num_partitions", [2, 4])
def test_triton_windowed_flash_decoding_partitions_merge(triton_device, num_partitions):
    """The long decode's window split into partitions (some of them before another token's
    window, or past a short context: they weigh nothing in the merge)."""
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(triton_device, num_partitions=num_partitions)
    case = mixed_case(backend, 16, 300, triton_device)
    torch.testing.assert_close(case.run(backend, 300, None), case.dense(300, None), atol=2e-5, rtol=0)


def test_triton_windowed_attention_in_bfloat16(triton_device):
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(triton_device)
    case = mixed_case(backend, 16, 40, triton_device, torch.bfloat16)
    torch.testing.assert_close(case.run(backend, 40, 2.0), case.dense(40, 2.0), atol=1e-2, rtol=2**-7)
