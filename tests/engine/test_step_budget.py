"""The step-time budget (pagedllm.engine.step_budget) and the scheduler's use of it: a long
prompt is cut into chunks sized from the measured cost per token while other requests run, and
computed in the step's whole token budget when it is alone. No timing here: steps' seconds are
given."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedllm.engine.requests import make_sequence_group
from pagedllm.engine.step_budget import FIRST_CHUNK, MIN_CHUNK, UNMEASURED_LOGPROB_PRICE, StepBudget
from pagedllm.sampling_params import SamplingParams
from tests.core.test_scheduler import Harness


def test_chunks_start_small_then_fill_the_budget_after_the_decoding_is_paid():
    budget = StepBudget(0.5, max_chunk=2048)
    assert budget.chunk_limit == FIRST_CHUNK
    budget.observe(0.05, prompt_tokens=0)  # a decode-only step: the base cost
    budget.observe(0.05 + 64 * 0.002, prompt_tokens=64)  # 2 ms per prompt token
    assert budget.chunk_limit == int(0.45 / 0.002)
    budget.observe(0.05 + 225 * 0.006, prompt_tokens=225)  # later chunks cost more (longer context)
    assert budget.chunk_limit == int(0.45 / 0.004)  # the running average follows
    budget.observe(10.0, prompt_tokens=0)  # decoding alone takes the whole budget
    assert budget.chunk_limit == MIN_CHUNK  # a prompt still advances
    fast = StepBudget(0.5, max_chunk=2048)
    fast.observe(0.01 + 64 * 1e-6, prompt_tokens=64)
    assert fast.chunk_limit == 2048
    assert StepBudget(None, max_chunk=2048).chunk_limit is None


def test_chunks_no_slower_than_the_base_step_after_step_never_overflow_the_limit():
    """Each such chunk halves the running cost; after ~1,070 of them it was a subnormal float
    whose quotient overflowed (`int(inf)`: an OverflowError inside the engine's step, seen in the
    speculative-decoding tests' 4,000 short requests). Now the cost reaches 0 and the limit is the
    whole budget, the log-probability price its unmeasured default."""
    budget = StepBudget(0.5, max_chunk=2048)
    budget.observe(0.05, prompt_tokens=0)
    budget.observe(0.05 + 64 * 0.002, prompt_tokens=64)
    budget.observe(0.05 + 64 * 0.004, prompt_tokens=64, logprob_tokens=64)  # an extra cost measured
    for _ in range(1200):
        budget.observe(0.05, prompt_tokens=64)
        assert MIN_CHUNK <= budget.chunk_limit <= 2048
        assert budget.logprob_price < float("inf")
    assert budget.cost == 0.0 and budget.chunk_limit == 2048
    assert budget.logprob_price == UNMEASURED_LOGPROB_PRICE


def test_too_few_prompt_tokens_say_nothing_about_their_cost():
    budget = StepBudget(0.5, max_chunk=2048)
    budget.observe(3.0, prompt_tokens=MIN_CHUNK - 1)
    assert budget.cost is None and budget.chunk_limit == FIRST_CHUNK


def test_the_scheduler_cuts_a_prompt_to_the_limit_only_beside_others():
    h = Harness(num_blocks=256, block_size=4, max_tokens_per_step=512)
    h.core.step_budget = SimpleNamespace(chunk_limit=32, logprob_price=1.0, observe=lambda *args: None)  # a fixed limit
    alone = h.add("alone", 200, 2)
    first = h.step()
    assert [len(s.token_ids) for s in first.seqs] == [200]  # alone: the whole token budget
    h.add("victim", 3, 50)
    h.step()  # alone's first token and the victim's prompt (3 tokens: under the limit)
    long = h.add("long", 200, 2)
    chunks = []
    for _ in range(10):
        out = h.step()
        chunks += [len(s.token_ids) for s in out.seqs if s.request_id == "long"]
        assert all(len(s.token_ids) == 1 for s in out.seqs if s.request_id == "victim")  # decodes every step
        if long.seqs[0].num_output_tokens:
            break
    assert chunks[:6] == [32] * 6 and sum(chunks) == 200 and max(chunks) == 32
    assert alone.seqs[0].num_output_tokens >= 1


def test_a_token_with_prompt_logprobs_is_priced_from_its_own_measured_cost():
    """Issue 51 item 6: prompt tokens with log-probabilities cost more (a row of the LM head and a
    pass over a vocabulary of up to 262k); priced as plain tokens, their first chunk overran the
    budget (a victim's gap 1.27-2.39 s for a 0.5 s budget)."""
    budget = StepBudget(0.5, max_chunk=2048)
    assert budget.logprob_price == UNMEASURED_LOGPROB_PRICE  # nothing known yet: a first chunk a quarter the size
    budget.observe(0.05, prompt_tokens=0)
    budget.observe(0.05 + 100 * 0.002, prompt_tokens=100, logprob_tokens=100)  # before any plain chunk: all as cost
    assert budget.cost == 0.002 and budget.extra is None
    budget.observe(0.05 + 100 * 0.001, prompt_tokens=100)  # a plain chunk
    assert budget.cost == 0.0015
    budget.observe(0.05 + 100 * 0.0015 + 50 * 0.006, prompt_tokens=100, logprob_tokens=50)
    assert budget.extra == pytest.approx(0.006) and budget.logprob_price == pytest.approx(1 + 0.006 / 0.0015)
    budget.observe(0.05 + 100 * 0.0015 + 5 * 0.1, prompt_tokens=100, logprob_tokens=5)  # too few to tell: as plain
    assert budget.extra == pytest.approx(0.006)


def test_the_scheduler_charges_prompt_logprob_tokens_their_price():
    h = Harness(num_blocks=256, block_size=4, max_tokens_per_step=512)
    h.core.step_budget = SimpleNamespace(chunk_limit=32, logprob_price=4.0, observe=lambda *args: None)
    h.add("victim", 3, 60)
    h.step()
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    scored = h.add_group(make_sequence_group("scored", list(range(1, 101)), params, h.requests, 10.0))
    plain = h.add("plain", 100, 2)
    chunks: dict[str, list[int]] = {"scored": [], "plain": []}
    for _ in range(20):
        out = h.step()
        for s in out.seqs:
            if s.request_id in chunks and s.start_position < 100:  # a prompt chunk
                chunks[s.request_id].append(len(s.token_ids))
        if scored.seqs[0].num_output_tokens and plain.seqs[0].num_output_tokens:
            break
    # 32 plain tokens a step; the scored prompt's tokens cost 4 each: 8 of them a step, and the
    # plain prompt behind it gets nothing in a step the scored one filled.
    assert chunks["scored"][:3] == [8, 8, 8] and sum(chunks["scored"]) == 100
    assert max(chunks["plain"]) == 32 and sum(chunks["plain"]) == 100
