"""The fast CPU PagedAttention backend against the reference backend (the oracle)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention import AttentionMetadata
from pagedllm.attention.cpu import CPUAttentionBackend
from pagedllm.attention.reference import ReferenceAttentionBackend
from tests.helpers import random_prompts


def _batch(query_lens, context_lens, block_size, num_blocks, seed):
    """Metadata for sequences whose blocks are scattered at random over the pool."""
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(num_blocks))
    tables, slots = [], []
    for q_len, ctx in zip(query_lens, context_lens):
        table = [int(free.pop()) for _ in range(-(-ctx // block_size))]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - q_len, ctx)]
    width = max(len(t) for t in tables)
    block_tables = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t)
    starts = np.concatenate([[0], np.cumsum(query_lens)])
    return tables, AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.from_numpy(starts),
        seq_lens=torch.tensor(context_lens),
        block_tables=block_tables,
        query_lens=list(query_lens),
        seq_lens_list=list(context_lens),
        block_size=block_size,
    )


def _fill_context(backend, tables, metadata, keys, values, block_size, shape, cache_dtype):
    """Write every context token's key and value (earlier tokens too) through the backend."""
    key_cache = torch.zeros(backend.kv_cache_shape(*shape), dtype=cache_dtype)
    value_cache = torch.zeros_like(key_cache)
    all_slots = torch.tensor(
        [t[p // block_size] * block_size + p % block_size for t, ctx in zip(tables, metadata.seq_lens_list) for p in range(ctx)]
    )
    full = AttentionMetadata(all_slots, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
                             metadata.query_lens, metadata.seq_lens_list, block_size)
    backend.write_kv(keys, values, key_cache, value_cache, full)
    return key_cache, value_cache


CASES = [
    ([1, 1, 1, 1], [1, 37, 128, 300]),  # decodes
    ([5, 1, 17], [5, 60, 40]),  # a fresh prompt, a decode, a chunk extending a cached context
    ([33, 1], [100, 1]),
    # Too few sequences to keep every thread busy: long contexts are split into partitions
    # whose partial softmax sums are merged.
    ([1], [1000]),
    ([1, 1], [700, 5]),
    ([40], [650]),
]


@pytest.mark.parametrize("block_size", [1, 16, 32, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
    ids=["f32", "bf16", "f32-with-bf16-cache"],
)
def test_cpu_backend_matches_reference(block_size, group, dtype, cache_dtype):
    num_kv_heads, head_dim = 2, 64
    num_heads = num_kv_heads * group
    for case, (query_lens, context_lens) in enumerate(CASES):
        gen = torch.Generator().manual_seed(case * 100 + block_size + group)
        tables, metadata = _batch(query_lens, context_lens, block_size, num_blocks=1200, seed=case)
        num_ctx = sum(context_lens)
        keys = torch.randn(num_ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        values = torch.randn(num_ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
        # This step's fresh keys/values: the last q_len of each sequence's context.
        ends = np.cumsum(context_lens)
        fresh = torch.cat([torch.arange(e - q, e) for e, q in zip(ends, query_lens)])
        results = []
        for backend in (ReferenceAttentionBackend(), CPUAttentionBackend()):
            kc, vc = _fill_context(backend, tables, metadata, keys, values, block_size, (1200, block_size, num_kv_heads, head_dim), cache_dtype)
            results.append(backend.forward(query, keys[fresh], values[fresh], kc, vc, metadata, head_dim**-0.5))
        # bfloat16 outputs: one rounding of a float32 result (attention math is float32 throughout).
        atol = 1e-5 if dtype == torch.float32 else 4e-3
        torch.testing.assert_close(results[1].float(), results[0].float(), atol=atol, rtol=0)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("context", [2, 17, 40, 127])
def test_one_kv_head_short_contexts_split_in_two_match_reference(block_size, context):
    """One decode of a model with one KV head (Gemma 3 270M: 4 heads, head_dim 256) is one
    (sequence, KV head) pair: even a context shorter than the partitions' minimum is split in two
    for two threads, and the partial softmax sums merged."""
    num_heads, head_dim = 4, 256
    gen = torch.Generator().manual_seed(context + block_size)
    tables, metadata = _batch([1], [context], block_size, num_blocks=300, seed=context)
    keys = torch.randn(context, 1, head_dim, generator=gen)
    values = torch.randn(context, 1, head_dim, generator=gen)
    query = torch.randn(1, num_heads, head_dim, generator=gen)
    results = []
    for backend in (ReferenceAttentionBackend(), CPUAttentionBackend()):
        kc, vc = _fill_context(backend, tables, metadata, keys, values, block_size, (300, block_size, 1, head_dim),
                               torch.float32)
        results.append(backend.forward(query, keys[-1:], values[-1:], kc, vc, metadata, head_dim**-0.5))
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_engine_outputs_equal_with_either_backend(tiny_llama, kv_cache_dtype):
    prompts = random_prompts(8, [3, 16, 29, 40], seed=60)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = {}
    for backend in ("reference", "cpu"):
        # A small token budget: prompts are chunked, so prefill with cached context is exercised.
        llm = LLM(str(tiny_llama), max_model_len=256, num_gpu_blocks=64, attention_backend=backend,
                  max_num_batched_tokens=24, max_num_seqs=8, kv_cache_dtype=kv_cache_dtype)
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs["cpu"] == outputs["reference"]


def test_auto_picks_the_cpu_kernel_on_cpu(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=128, num_gpu_blocks=16)
    assert llm.llm_engine.executor.worker.backend.name == "cpu"
    half = LLM(str(tiny_llama), max_model_len=128, num_gpu_blocks=16, dtype="float16")
    assert half.llm_engine.executor.worker.backend.name == "reference"  # the kernel has no float16
