"""A preemption storm: requests arriving over time whose KV demand is ten times the cache, with
greedy decoding, parallel sampling (`n > 1`), `best_of` and beam search, under swapping and
under recomputation. Every output equals that of the same engine with room for everything, and
both pools end empty. (tests/test_preemption.py proves the mechanisms on a fixed batch; this is
the storm.)"""

from __future__ import annotations

import time

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.utils import cdiv
from tests.helpers import random_prompts

BLOCK_SIZE = 16
MAX_MODEL_LEN = 128
# A vocabulary of 4096 rather than the tokenizer's 49152: the engine's work is the same, but the
# LM head and the sampler, which dominate a tiny model's step, cost twelve times less.
VOCAB_SIZE = 4096
ARRIVAL_STEPS = 16  # fewer than the shortest request's max_tokens (24)


def _workload(num_requests: int):
    """(prompt, params, sequences it runs) per request. Sampled requests are seeded and use
    top-k: recomputation changes logits in their last bits, which must not move a draw from
    the near-flat distribution of a random model across a boundary."""
    prompts = random_prompts(num_requests, [7, 19, 33, 12, 48, 25], seed=23, high=VOCAB_SIZE)
    kinds = [
        (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), 1),
        (SamplingParams(n=3, temperature=1.0, top_k=20, seed=7, max_tokens=32, ignore_eos=True), 3),
        (SamplingParams(temperature=0, max_tokens=56, ignore_eos=True), 1),
        (SamplingParams(n=2, best_of=4, temperature=0.9, top_k=20, seed=11, max_tokens=28, ignore_eos=True), 4),
        (SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0, max_tokens=24, ignore_eos=True), 3),
        (SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=48, ignore_eos=True), 1),
    ]
    return [(prompt, *kinds[i % len(kinds)]) for i, prompt in enumerate(prompts)]


def _blocks_wanted(prompt: list[int], params: SamplingParams, num_seqs: int) -> int:
    """Blocks the request holds at its longest, every sequence counted whole (no sharing)."""
    return num_seqs * cdiv(len(prompt) + params.max_tokens, BLOCK_SIZE)


def _run(llm: LLM, workload) -> tuple[dict[str, list[list[int]]], int]:
    """Feed the requests in over the first ARRIVAL_STEPS steps, sooner than any can finish, so
    that the demand in flight is the whole workload's; (token ids per request and choice,
    steps taken)."""
    engine = llm.llm_engine
    pending = list(enumerate(workload))
    per_step = cdiv(len(pending), ARRIVAL_STEPS)
    outputs: dict[str, list[list[int]]] = {}
    steps = 0
    while pending or engine.has_unfinished_requests():
        for index, (prompt, params, _) in pending[:per_step]:
            engine.add_request(str(index), prompt, params)
        del pending[:per_step]
        for out in engine.step():
            if out.finished:
                assert out.error is None, out.error
                outputs[out.request_id] = [c.token_ids for c in out.outputs]
        steps += 1
    return outputs, steps


@pytest.fixture(scope="module")
def small_vocab_llama(tiny_models):
    return tiny_models("llama", vocab_size=VOCAB_SIZE)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Compute on one thread, as the servers of this suite do (see ONE_THREAD in common.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def storm(small_vocab_llama, long_form):
    workload = _workload(480 if long_form else 120)
    demand = sum(_blocks_wanted(*request) for request in workload)
    largest = max(_blocks_wanted(*request) for request in workload)
    budget = max(demand // 10, largest)
    unconstrained = LLM(str(small_vocab_llama), max_model_len=MAX_MODEL_LEN, num_gpu_blocks=2 * demand, max_num_seqs=256)
    reference, _ = _run(unconstrained, workload)
    assert unconstrained.llm_engine.get_stats().num_preemptions == 0
    return workload, demand, budget, reference


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_preemption_storm_changes_no_output(small_vocab_llama, storm, mode, figures):
    workload, demand, budget, reference = storm
    llm = LLM(str(small_vocab_llama), max_model_len=MAX_MODEL_LEN, num_gpu_blocks=budget, swap_space=0.01,
              preemption_mode=mode, max_num_seqs=256)
    begin = time.monotonic()
    outputs, steps = _run(llm, workload)
    elapsed = time.monotonic() - begin
    stats = llm.llm_engine.get_stats()
    identical = sum(outputs.get(str(i)) == reference[str(i)] for i in range(len(workload)))
    figures(
        f"preemption storm ({mode})",
        f"{len(workload)} requests (greedy, n=3, best_of=4, beams of 3) wanting {demand} blocks on a cache of "
        f"{budget} ({demand / budget:.1f}x) in {steps} steps, {elapsed:.1f} s: {stats.num_preemptions} preemptions "
        f"({stats.num_swap_preemptions} swaps of {stats.num_blocks_swapped_out} blocks, "
        f"{stats.num_recompute_preemptions} recomputations); {identical}/{len(workload)} outputs identical to "
        f"the unconstrained run; blocks free after: {stats.num_free_blocks}/{stats.num_total_blocks} device, "
        f"{stats.num_free_cpu_blocks}/{stats.num_cpu_blocks} CPU",
    )
    assert identical == len(workload)
    assert stats.num_preemptions >= len(workload) // 4  # a storm, not a drizzle
    if mode == "swap":
        assert stats.num_swap_preemptions > stats.num_recompute_preemptions
    else:
        assert stats.num_swap_preemptions == 0
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_free_cpu_blocks == stats.num_cpu_blocks
