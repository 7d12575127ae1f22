"""Sizing the KV cache on a GPU by vLLM's rule (gpu_memory_utilization less the profiled peak of
weights and activations): the arithmetic and the profile batch, checked on a CPU; the profile
run itself on a GPU."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import GiB, EngineArgs
from pagedllm.utils import cdiv
from pagedllm.worker.worker import gpu_kv_cache_budget, profile_batch


def test_the_kv_cache_gets_what_the_fraction_leaves_after_the_peak():
    # 80 GiB device at 0.9 = 72 GiB; weights + activations peaked at 20 GiB, CUDA context 1 GiB.
    assert gpu_kv_cache_budget(80 * GiB, 0.9, 20 * GiB, 1 * GiB) == int(80 * GiB * 0.9) - 21 * GiB


def test_a_fraction_that_leaves_nothing_says_what_to_change():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.2 gives this engine 16.00 GiB .* take 21.00 GiB"):
        gpu_kv_cache_budget(80 * GiB, 0.2, 20 * GiB, 1 * GiB)


@pytest.mark.parametrize(("num_tokens", "max_model_len", "block_size"), [(2048, 8192, 16), (8192, 2048, 16), (5000, 1024, 32), (7, 100, 8)])
def test_the_profile_batch_is_the_largest_step_within_the_context(num_tokens, max_model_len, block_size):
    items = profile_batch(num_tokens, max_model_len, block_size)
    assert sum(len(item.token_ids) for item in items) == num_tokens
    assert all(len(item.token_ids) <= max_model_len and item.start_position == 0 for item in items)
    assert len(items) == cdiv(num_tokens, max_model_len)
    blocks = [b for item in items for b in item.block_table]
    assert all(len(item.block_table) == cdiv(len(item.token_ids), block_size) for item in items)
    assert sorted(blocks) == list(range(len(blocks)))  # distinct blocks, numbered from 0


@pytest.mark.parametrize("value", [0, -0.5, 1.5, float("nan")])
def test_gpu_memory_utilization_outside_0_1_is_refused(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in \\(0, 1\\]"):
        EngineArgs(gpu_memory_utilization=value).create_engine_config()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_engine_takes_about_the_fraction_it_is_given(tiny_llama):
    from pagedllm import LLM

    free_before, total = torch.cuda.mem_get_info()
    llm = LLM(str(tiny_llama), device="cuda", gpu_memory_utilization=0.3, max_model_len=256)
    used = torch.cuda.memory_reserved()
    assert 0.2 * total < used <= 0.3 * total
    assert llm.llm_engine.get_stats().num_total_blocks > 0
