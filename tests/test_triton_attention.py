"""The Triton PagedAttention kernels against the reference backend (the oracle).

Every test body runs on CPU tensors, in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 when there is no GPU), and on a GPU, compiled (marked `gpu`; skipped, with the
reason, where there is none). Shapes are tiny: the interpreter runs programs one at a time.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.attention import AttentionMetadata, get_attention_backend  # noqa: E402
from pagedllm.attention import backend as backend_module  # noqa: E402
from pagedllm.attention.reference import ReferenceAttentionBackend  # noqa: E402
from pagedllm.attention.triton_backend import (  # noqa: E402
    MAX_PARTITIONS,
    MIN_PARTITION_TOKENS,
    TritonAttentionBackend,
    choose_num_partitions,
)
from pagedllm.config import EngineArgs  # noqa: E402
from pagedllm.kernels.triton_attention import INTERPRETED  # noqa: E402
from tests.helpers import random_prompts  # noqa: E402

NUM_BLOCKS = 160


@pytest.fixture
def device(triton_device):
    return triton_device


def _batch(query_lens, context_lens, block_size, device, seed=0):
    """Metadata for sequences whose blocks are scattered at random over the pool, and the slots
    of every context token (to fill the cache with)."""
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(NUM_BLOCKS))
    tables, slots, context_slots = [], [], []
    for q_len, ctx in zip(query_lens, context_lens):
        table = [int(free.pop()) for _ in range(-(-ctx // block_size))]
        tables.append(table)
        seq_slots = [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        context_slots += seq_slots
        slots += seq_slots[ctx - q_len :]
    block_tables = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int32)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = torch.tensor(table)
    starts = np.concatenate([[0], np.cumsum(query_lens)])
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.from_numpy(starts).to(device),
        seq_lens=torch.tensor(context_lens, device=device),
        block_tables=block_tables.to(device),
        query_lens=list(query_lens),
        seq_lens_list=list(context_lens),
        block_size=block_size,
        num_decodes=sum(1 for q in query_lens if q == 1),
    )
    return metadata, torch.tensor(context_slots, dtype=torch.int64, device=device)


def _reference_cache(metadata, context_slots, keys, values, cache_dtype, block_size):
    """Pools in the reference layout, [blocks, block_size, kv_heads, head_dim], holding every
    context token, written by the reference backend."""
    num_kv_heads, head_dim = keys.shape[1:]
    shape = ReferenceAttentionBackend().kv_cache_shape(NUM_BLOCKS, block_size, num_kv_heads, head_dim)
    key_cache = torch.zeros(shape, dtype=cache_dtype, device=keys.device)
    value_cache = torch.zeros_like(key_cache)
    fill = AttentionMetadata(context_slots, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables,
                             metadata.query_lens, metadata.seq_lens_list, block_size)
    ReferenceAttentionBackend().write_kv(keys, values, key_cache, value_cache, fill)
    return key_cache, value_cache


def _check(query_lens, context_lens, *, block_size, group, device, dtype=torch.float32, cache_dtype=None,
           num_kv_heads=2, head_dim=32, num_partitions=None, seed=0):
    """The Triton backend's attention outputs against the reference's on the same cache."""
    cache_dtype = cache_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    metadata, context_slots = _batch(query_lens, context_lens, block_size, device, seed)
    num_ctx = sum(context_lens)
    keys = torch.randn(num_ctx, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    values = torch.randn(num_ctx, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gen).to(device, dtype)
    key_cache, value_cache = _reference_cache(metadata, context_slots, keys, values, cache_dtype, block_size)
    scale = head_dim**-0.5
    expected = ReferenceAttentionBackend().forward(query, None, None, key_cache, value_cache, metadata, scale)
    # The same contents in the Triton layout, [blocks, kv_heads, block_size, head_dim] (the write
    # kernel has its own test: the interpreter runs it one token at a time).
    backend = TritonAttentionBackend(device, num_partitions=num_partitions)
    out = backend.forward(query, None, None, key_cache.transpose(1, 2).contiguous(),
                          value_cache.transpose(1, 2).contiguous(), metadata, scale)
    assert out.dtype == dtype and out.shape == query.shape
    # float32: the same math in another order. A 16-bit output is one rounding of a float32
    # result, so two correct ones may differ by a unit in the last place (at most 2**-7 of the
    # value in bfloat16, 2**-10 in float16); beyond that they agree within 1e-4.
    tolerance = {
        torch.float32: dict(atol=1e-5, rtol=0),
        torch.bfloat16: dict(atol=1e-4, rtol=2**-7),
        torch.float16: dict(atol=1e-4, rtol=2**-10),
    }[dtype]
    torch.testing.assert_close(out.float(), expected.float(), **tolerance)


# Decodes only (the small-tile launch): contexts of one token, of part of a block, of several
# blocks of every size.
DECODES = ([1, 1, 1, 1], [1, 37, 130, 260])
# One launch for a mixed step: decodes, a fresh prompt, a chunk extending a cached context, and a
# longer chunk over a longer cached context (several items of one sequence when GQA groups are
# large).
MIXED = ([1, 1, 5, 17, 40], [64, 129, 5, 40, 150])


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [8, 128])
def test_decode_attention_matches_reference(device, block_size, group):
    _check(*DECODES, block_size=block_size, group=group, device=device)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
def test_mixed_step_attention_matches_reference(device, block_size, group):
    _check(*MIXED, block_size=block_size, group=group, device=device)


@pytest.mark.parametrize(
    "dtype, cache_dtype, block_size, group",
    [
        (torch.bfloat16, torch.bfloat16, 16, 3),
        (torch.bfloat16, torch.bfloat16, 128, 1),
        (torch.float16, torch.float16, 32, 4),
        (torch.float32, torch.bfloat16, 8, 4),  # a bfloat16 cache under a float32 model
    ],
    ids=["bf16-b16-g3", "bf16-b128-g1", "f16-b32-g4", "f32-with-bf16-cache-b8-g4"],
)
def test_attention_in_16_bit_matches_reference(device, dtype, cache_dtype, block_size, group):
    _check(*MIXED, block_size=block_size, group=group, device=device, dtype=dtype, cache_dtype=cache_dtype)


def test_attention_with_unpadded_shapes(device):
    """A head size and a number of KV heads that are not powers of two (masked, not padded)."""
    _check(*MIXED, block_size=16, group=3, device=device, num_kv_heads=3, head_dim=24)


@pytest.mark.parametrize("num_partitions", [1, 2, 4])
def test_flash_decoding_partitions_merge_to_the_same_output(device, num_partitions):
    """Contexts split into partitions merged by their softmax sums; a partition past the end of a
    short context sees no key at all."""
    _check([1, 1, 1], [3, 90, 250], block_size=16, group=3, device=device, num_partitions=num_partitions)
    _check([1, 6], [200, 40], block_size=32, group=1, device=device, num_partitions=num_partitions,
           dtype=torch.bfloat16)


def test_partitions_are_chosen_for_few_long_sequences():
    target = 512
    assert choose_num_partitions(num_items=256, num_kv_heads=8, max_seq_len=4096, target_programs=target) == 1
    one_sequence = choose_num_partitions(num_items=1, num_kv_heads=8, max_seq_len=4096, target_programs=target)
    assert one_sequence == 4096 // MIN_PARTITION_TOKENS  # each partition keeps its minimum of tokens
    few_tokens = 2 * MIN_PARTITION_TOKENS - 1
    assert choose_num_partitions(num_items=1, num_kv_heads=8, max_seq_len=few_tokens, target_programs=target) == 1
    assert choose_num_partitions(num_items=1, num_kv_heads=1, max_seq_len=10**6, target_programs=10**6) == (
        MAX_PARTITIONS
    )
    # The interpreter runs one program at a time: it never splits.
    assert choose_num_partitions(num_items=1, num_kv_heads=1, max_seq_len=10**6, target_programs=1) == 1


@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
     (torch.float32, torch.bfloat16)],
    ids=["f32", "bf16", "f16", "f32-to-bf16"],
)
def test_write_kv_equals_the_reference_write(device, dtype, cache_dtype):
    """Keys and values land in their slots bit for bit as the reference writes them (float32 to
    bfloat16 rounds to nearest even), read from strided views as the model's projection gives them."""
    block_size, num_kv_heads, head_dim, num_tokens = 16, 3, 24, 40
    gen = torch.Generator().manual_seed(5)
    # k and v: column slices of one [num_tokens, q | k | v] projection output.
    qkv = torch.randn(num_tokens, 5 * num_kv_heads * head_dim, generator=gen).to(device, dtype)
    width = num_kv_heads * head_dim
    key = qkv[:, 3 * width : 4 * width].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 4 * width :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.from_numpy(np.random.default_rng(5).permutation(NUM_BLOCKS * block_size)[:num_tokens]).to(device)
    metadata = AttentionMetadata(slots, None, None, None, [], [], block_size)
    caches = {}
    for backend in (ReferenceAttentionBackend(), TritonAttentionBackend(device)):
        shape = backend.kv_cache_shape(NUM_BLOCKS, block_size, num_kv_heads, head_dim)
        caches[backend.name] = [torch.zeros(shape, dtype=cache_dtype, device=device) for _ in range(2)]
        backend.write_kv(key, value, *caches[backend.name], metadata)
    for reference, written in zip(caches["reference"], caches["triton"]):
        # reference: [blocks, block_size, kv_heads, head_dim]; triton: [blocks, kv_heads, block_size, head_dim]
        assert torch.equal(written, reference.transpose(1, 2))


@pytest.mark.parametrize("block_size", [1, 4, 24, 256])
def test_unsupported_block_sizes_are_refused(device, block_size):
    backend = TritonAttentionBackend(device)
    with pytest.raises(ValueError, match=r"block sizes 8, 16, 32, 64, 128, not " + str(block_size)):
        backend.kv_cache_shape(16, block_size, 2, 32)


def test_auto_picks_triton_on_a_gpu(monkeypatch):
    # Building the backend touches no GPU; the choice is what is checked.
    assert get_attention_backend("auto", torch.device("cuda")).name == "triton"
    monkeypatch.setattr(backend_module, "_triton_available", lambda device: False)
    assert get_attention_backend("auto", torch.device("cuda")).name == "reference"
    with pytest.raises(ValueError, match="needs the triton package"):
        get_attention_backend("triton", torch.device("cuda"))


def test_an_unknown_backend_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="'auto', 'reference', 'cpu', 'triton'"):
        EngineArgs(attention_backend="flash").create_engine_config()


def test_engine_greedy_tokens_equal_the_reference_backend(device, tiny_llama):
    """Chunked prompts (a small token budget) and prefix-cache hits (prompts sharing a prefix)
    run prompt tokens over cached contexts, in steps that mix them with decodes."""
    shared = random_prompts(1, [20], seed=71)[0]
    first, last = (shared + p for p in random_prompts(2, [3, 25], seed=72))
    # The last prompt arrives after the first one's blocks are computed, so it finds them cached.
    prompts = [first, *random_prompts(2, [9, 30], seed=73), last]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for backend in ("reference", "triton"):
        llm = LLM(str(tiny_llama), device=device.type, dtype="float32", max_model_len=64, num_gpu_blocks=40,
                  block_size=8, attention_backend=backend, max_num_batched_tokens=24, max_num_seqs=4)
        assert llm.llm_engine.executor.worker.backend.name == backend
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.llm_engine.get_stats().prefix_cache_hits > 0
    assert outputs["triton"] == outputs["reference"]
