"""Decode steps through CUDA graphs' static buffers, and swaps on a side stream.

On a GPU (marked `gpu`) the engine captures its graphs itself and its greedy tokens must equal
the reference backend's and an eager run's. On a CPU the same static-buffer path runs in
Triton's interpreter without capture (`DecodeGraphs(capture=False)`): batches padded to a
bucket, padding rows that must write nothing, the fixed flash-decoding split, block tables as
wide as the context. The swap test needs a GPU: on a CPU swaps are plain copies, tested in
tests/test_preemption.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.attention import AttentionMetadata  # noqa: E402
from pagedllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedllm.kernels.triton_attention import INTERPRETED  # noqa: E402
from pagedllm.worker.cache_engine import contiguous_runs  # noqa: E402
from pagedllm.worker.cuda_graphs import DecodeGraphs, capture_sizes  # noqa: E402
from tests.helpers import random_prompts  # noqa: E402


@pytest.fixture
def device(triton_device):
    return triton_device


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(4) == (1, 2, 4)
    assert capture_sizes(5) == (1, 2, 4, 8)
    assert capture_sizes(100)[-3:] == (80, 96, 112)
    assert capture_sizes(256)[-1] == 256 and capture_sizes(1000)[-1] == 256


def test_contiguous_runs_merge_consecutive_pairs_only():
    assert contiguous_runs([(5, 9), (3, 7), (4, 8), (10, 1)]) == [(3, 7, 3), (10, 1, 1)]
    assert contiguous_runs([(1, 2), (2, 4)]) == [(1, 2, 1), (2, 4, 1)]  # destinations not consecutive
    assert contiguous_runs([]) == []


def test_negative_slots_are_padding_and_not_written(device):
    backend = TritonAttentionBackend(device)
    shape = backend.kv_cache_shape(4, 8, 2, 16)
    key_cache, value_cache = (torch.full(shape, 7.0, device=device) for _ in range(2))
    key, value = (torch.randn(3, 2, 16, device=device) for _ in range(2))
    slots = torch.tensor([5, -1, 17], device=device)
    metadata = AttentionMetadata(slot_mapping=slots, query_start_loc=None, seq_lens=None, block_tables=None,
                                 query_lens=[1, 1, 1], seq_lens_list=[1, 1, 1], block_size=8)
    backend.write_kv(key, value, key_cache, value_cache, metadata)
    expected_keys = torch.full(shape, 7.0, device=device)
    expected_keys[0, :, 5] = key[0]
    expected_keys[2, :, 1] = key[2]
    assert torch.equal(key_cache, expected_keys)
    assert (value_cache == 7.0).sum() == value_cache.numel() - 2 * 2 * 16


def _generate(llm, prompts):
    # Different lengths end sequences at different steps: batches of 3, 2, 1 run padded to buckets.
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 7, 3)]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


COMMON = dict(dtype="float32", max_model_len=64, num_gpu_blocks=40, block_size=8, max_num_seqs=4)


def _through_static_buffers(device, path, prompts):
    """(the reference backend's greedy tokens, the Triton engine's, its decode graphs or their
    CPU stand-in, the engine)."""
    common = dict(device=device.type, **COMMON)
    expected = _generate(LLM(str(path), attention_backend="reference", **common), prompts)
    llm = LLM(str(path), attention_backend="triton", **common)
    worker = llm.llm_engine.executor.worker
    if device.type == "cpu":  # no capture on a CPU: the same buffers, run eagerly
        assert worker.runner.graphs is None
        worker.runner.graphs = DecodeGraphs(worker.model, worker.backend, 8, 64, 4, device, capture=False)
    graphs = worker.runner.graphs
    return expected, _generate(llm, prompts), graphs, llm


def test_decode_steps_through_static_buffers_equal_the_reference_backend(device, tiny_llama):
    prompts = random_prompts(3, [5, 19, 33], seed=91)
    expected, got, graphs, _ = _through_static_buffers(device, tiny_llama, prompts)
    assert graphs.sizes == (1, 2, 4)
    assert got == expected
    assert graphs.replays >= 11  # every decode step: 11 for the longest output

    if device.type == "cuda":
        eager = LLM(str(tiny_llama), attention_backend="triton", enforce_eager=True, device="cuda", **COMMON)
        assert eager.llm_engine.executor.worker.runner.graphs is None
        assert _generate(eager, prompts) == expected


@pytest.mark.parametrize(
    "arch, overrides",
    [("mistral", {"sliding_window": 9}), ("qwen2", {"use_sliding_window": True, "sliding_window": 9, "max_window_layers": 1})],
    ids=["mistral", "qwen2-hybrid"],
)
def test_windowed_models_decode_through_static_buffers(device, tiny_models, arch, overrides):
    """Every layer sliding (one KV cache group) and a hybrid (a full and a windowed group, each
    with its own static slots, block tables and flash-decoding split), past the window: the same
    greedy tokens as the reference backend."""
    prompts = random_prompts(3, [5, 19, 33], seed=92)
    expected, got, graphs, llm = _through_static_buffers(device, tiny_models(arch, **overrides), prompts)
    assert graphs.group_windows == ([9] if arch == "mistral" else [None, 9])
    assert got == expected
    assert graphs.replays >= 11 and llm.llm_engine.block_manager.num_window_frees > 0


@pytest.mark.gpu
def test_swap_preemption_on_the_side_stream_keeps_greedy_tokens(tiny_llama):
    if not torch.cuda.is_available() or INTERPRETED:
        pytest.skip("needs a CUDA device with compiled Triton kernels: swaps go on a CUDA stream there")
    prompts = random_prompts(6, [30, 41, 25, 50, 37, 44], seed=93)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", max_model_len=128, block_size=8, attention_backend="triton")
    roomy = LLM(str(tiny_llama), num_gpu_blocks=200, **common)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(str(tiny_llama), num_gpu_blocks=24, preemption_mode="swap", **common)
    assert tight.llm_engine.executor.worker.cache_engine.swap_stream is not None
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    stats = tight.llm_engine.get_stats()
    assert stats.num_blocks_swapped_out > 0 and stats.num_blocks_swapped_in > 0
    assert got == expected
