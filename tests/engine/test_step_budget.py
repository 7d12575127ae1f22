"""The step-time budget (pagedllm.engine.step_budget) and the scheduler's use of it: a long
prompt is cut into chunks sized from the measured cost per token while other requests run, and
computed in the step's whole token budget when it is alone. No timing here: steps' seconds are
given."""

from __future__ import annotations

from types import SimpleNamespace

from pagedllm.engine.step_budget import FIRST_CHUNK, MIN_CHUNK, StepBudget
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


def test_too_few_prompt_tokens_say_nothing_about_their_cost():
    budget = StepBudget(0.5, max_chunk=2048)
    budget.observe(3.0, prompt_tokens=MIN_CHUNK - 1)
    assert budget.cost is None and budget.chunk_limit == FIRST_CHUNK


def test_the_scheduler_cuts_a_prompt_to_the_limit_only_beside_others():
    h = Harness(num_blocks=256, block_size=4, max_tokens_per_step=512)
    h.core.step_budget = SimpleNamespace(chunk_limit=32, observe=lambda seconds, prompt_tokens: None)  # a fixed limit
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
