"""Preemption by swapping and by recomputation: outputs never change, blocks come back intact,
pools end empty, and a request that can never fit is refused at admission."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.reference import ReferenceAttentionBackend
from pagedllm.worker.cache_engine import CacheEngine
from tests.helpers import random_prompts


def test_swapped_blocks_come_back_with_the_same_bytes():
    torch.manual_seed(0)
    cache = CacheEngine(ReferenceAttentionBackend(), num_layers=3, num_kv_heads=2, head_dim=8, block_size=4,
                        num_device_blocks=16, num_cpu_blocks=6, dtype=torch.float32, device=torch.device("cpu"))
    for pool in cache.key_caches + cache.value_caches:
        pool.copy_(torch.randn_like(pool))
    out_blocks = [3, 7, 9]
    saved = [pool[out_blocks].clone() for pool in cache.key_caches + cache.value_caches]
    cache.swap_out([(d, c) for d, c in zip(out_blocks, [5, 0, 2])])
    for pool in cache.key_caches + cache.value_caches:
        pool.zero_()  # the device blocks are reused by others meanwhile
    cache.swap_in([(c, d) for c, d in zip([5, 0, 2], [10, 11, 12])])
    for before, pool in zip(saved, cache.key_caches + cache.value_caches):
        assert torch.equal(pool[[10, 11, 12]], before)
    cache.copy([(10, 1), (11, 2)])  # copy-on-write duplicates whole blocks
    for before, pool in zip(saved, cache.key_caches + cache.value_caches):
        assert torch.equal(pool[[1, 2]], before[:2])


def _workload():
    """Greedy, seeded and parallel-sampling and beam requests. Recomputation changes logits in
    their last bits, so a draw from the near-flat distribution of a random model could land on
    the other side of a boundary; the sampled requests use top-k, as real sampling does."""
    prompts = random_prompts(10, [10, 23, 37, 16, 31, 8], seed=40)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=24, ignore_eos=True)
    params = [greedy] * 6 + [
        seeded,
        SamplingParams(temperature=1.0, top_p=0.9, top_k=40, seed=4, max_tokens=24, ignore_eos=True),
        SamplingParams(n=3, temperature=1.0, top_k=20, seed=5, max_tokens=20, ignore_eos=True),
        SamplingParams(n=3, best_of=3, use_beam_search=True, temperature=0, max_tokens=20, ignore_eos=True),
    ]
    return prompts, params


@pytest.fixture(scope="module")
def unconstrained(tiny_llama):
    prompts, params = _workload()
    llm = LLM(str(tiny_llama), max_model_len=128, num_gpu_blocks=512)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions == 0
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_outputs_are_identical_under_heavy_preemption(tiny_llama, unconstrained, mode):
    prompts, params = _workload()
    # 12 blocks of 16 tokens for requests that together want about 40.
    llm = LLM(str(tiny_llama), max_model_len=128, num_gpu_blocks=12, swap_space=0.01, preemption_mode=mode, max_num_seqs=16)
    engine = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    outputs, peak_cpu_blocks = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = [c.token_ids for c in out.outputs]
        stats = engine.get_stats()
        peak_cpu_blocks = max(peak_cpu_blocks, stats.num_cpu_blocks - stats.num_free_cpu_blocks)
    assert [outputs[str(i)] for i in range(len(prompts))] == unconstrained
    stats = engine.get_stats()
    assert stats.num_preemptions >= 5
    if mode == "recompute":
        assert stats.num_swap_preemptions == 0 and peak_cpu_blocks == 0
    else:  # on a CPU, swapping a block is far cheaper than recomputing it: auto swaps too
        assert stats.num_swap_preemptions > 0 and peak_cpu_blocks > 0
        assert stats.num_blocks_swapped_out > 0 and stats.num_blocks_swapped_in > 0
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_free_cpu_blocks == stats.num_cpu_blocks


def test_full_cpu_pool_falls_back_to_recomputation(tiny_llama, unconstrained):
    prompts, params = _workload()
    # Bytes per block of the tiny model: 2 layers x (keys + values) x 16 tokens x 2 heads x 16 x 4 B = 8 KiB.
    two_blocks = 2 * 8192 / 2**30
    llm = LLM(str(tiny_llama), max_model_len=128, num_gpu_blocks=12, swap_space=two_blocks, preemption_mode="swap", max_num_seqs=16)
    assert llm.llm_engine.get_stats().num_cpu_blocks == 2
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_swap_preemptions > 0 and stats.num_recompute_preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in outputs] == unconstrained


# The tiny model's blocks hold 16 tokens; a 60-token prompt fills 3 of them and part of a 4th.
# n samples of up to 60 + m tokens write at most 59 + m tokens each (the last sampled token's KV
# never is): they share the 3 full prompt blocks and each holds ceil((59 + m) / 16) - 3 more.


def test_a_request_that_can_never_fit_is_refused_at_admission_and_others_proceed(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=128, num_gpu_blocks=12, swap_space=0.01)
    prompts = random_prompts(3, [60, 12, 20], seed=41)
    # 4 samples of up to 60 + 68 tokens: 3 + 4 x (8 - 3) = 23 blocks > 12.
    too_large = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=68, ignore_eos=True)
    with pytest.raises(ValueError, match=r"can never fit the KV cache: 4 sequences \(samples\) of up to 60 prompt "
                                         r"\+ 68 output tokens need up to 23 blocks of 16 tokens, but the cache has 12"):
        llm.generate(prompts[0], too_large, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(prompts[1:], greedy, use_tqdm=False)
    assert all(o.error is None and len(o.outputs[0].token_ids) == 10 for o in outputs)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_request_that_fills_the_cache_exactly_is_admitted_and_completes(tiny_llama, mode):
    """3 samples of up to 60 + 37 tokens: 3 + 3 x (6 - 3) = 12 blocks, the whole cache; one more
    output token would need 3 + 3 x (7 - 3) = 15. The bound is exact, not merely safe."""
    llm = LLM(str(tiny_llama), max_model_len=128, num_gpu_blocks=12, swap_space=0.01, preemption_mode=mode)
    prompt = random_prompts(1, [60], seed=41)[0]
    with pytest.raises(ValueError, match="need up to 15 blocks"):
        llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=38, ignore_eos=True), use_tqdm=False)
    output = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=37, ignore_eos=True), use_tqdm=False)[0]
    assert output.error is None
    assert [len(c.token_ids) for c in output.outputs] == [37] * 3
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_without_max_tokens_the_output_is_bounded_by_what_the_cache_holds(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=128, num_gpu_blocks=12, swap_space=0.01)
    prompt = random_prompts(1, [60], seed=41)[0]
    output = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert output.error is None
    assert [(len(c.token_ids), c.finish_reason) for c in output.outputs] == [(37, "length")] * 3
    # A single sequence has room for the whole context (ceil(127 / 16) = 8 blocks).
    single = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(single.outputs[0].token_ids) == 128 - 60


def test_a_beam_search_that_can_never_fit_is_refused_naming_its_beams(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=128, num_gpu_blocks=12, swap_space=0.01)
    prompt = random_prompts(1, [60], seed=41)[0]
    with pytest.raises(ValueError, match=r"4 sequences \(beams\) .* need up to 23 blocks"):
        llm.generate(prompt, SamplingParams(n=4, use_beam_search=True, temperature=0, max_tokens=68, ignore_eos=True),
                     use_tqdm=False)


def test_swap_space_is_never_larger_than_the_device_pool(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=128, num_gpu_blocks=10, swap_space=4)
    assert llm.llm_engine.get_stats().num_cpu_blocks == 10
