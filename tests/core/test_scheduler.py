"""The scheduler (no model; the engine core over a stand-in executor): FCFS admission, budgets,
chunked prefill, preemption by recomputation with the latest arrival evicted first, and the
control message it emits."""

from __future__ import annotations

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core import BlockManager, Scheduler, SchedulerOutput, Sequence, SequenceGroup, SequenceStatus
from pagedllm.core.model_output import SampledToken
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.requests import RequestRegistry, make_sequence_group
from pagedllm.sampling_params import SamplingParams
from tests.engine.fakes import FakeExecutor, FakeTokenizer, samples_of


class Harness:
    """The engine's own `EngineCore` over a stand-in model: every sampled sequence gets token 7;
    a sequence finishes once it has `max_tokens` outputs."""

    def __init__(self, num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_per_step=64, cpu_blocks=0, mode="recompute"):
        self.bm = BlockManager(block_size, num_blocks, cpu_blocks, enable_prefix_caching=False, watermark=0.0)
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens_per_step, preemption_mode=mode, watermark=0.0)
        self.scheduler = Scheduler(config, self.bm)
        self.requests = RequestRegistry()
        processor = OutputProcessor(FakeTokenizer(), self.requests, max_model_len=10**6, eos_token_ids=[])
        executor = FakeExecutor(samples_of(lambda item: [SampledToken(7, 0.0)] * item.num_samples))
        self.core = EngineCore(self.scheduler, executor, processor.process, self.requests)
        self.groups: dict[str, SequenceGroup] = {}  # every group added, finished or not
        self.clock = 0.0

    def add(self, request_id: str, prompt_len: int, max_tokens: int) -> SequenceGroup:
        self.clock += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        return self.add_group(make_sequence_group(request_id, list(range(1, prompt_len + 1)), params, self.requests, self.clock))

    def add_group(self, group: SequenceGroup) -> SequenceGroup:
        self.groups[group.request_id] = group
        self.core.add(group)
        return group

    def step(self) -> SchedulerOutput:
        return self.core.step().scheduled or SchedulerOutput()

    def run(self, max_steps=1000):
        outs = []
        while self.scheduler.has_unfinished() and len(outs) < max_steps:
            outs.append(self.step())
        assert not self.scheduler.has_unfinished()
        return outs


def test_first_step_admits_prompts_in_arrival_order_within_max_num_seqs():
    h = Harness(max_num_seqs=2)
    for i in range(3):
        h.add(f"r{i}", prompt_len=5, max_tokens=2)
    out = h.step()
    assert [s.request_id for s in out.seqs] == ["r0", "r1"]
    assert all(s.start_position == 0 and len(s.token_ids) == 5 and s.num_samples == 1 for s in out.seqs)
    out = h.step()
    # r0 and r1 decode their last token (one each); r2 waits for a free seat.
    assert [(s.request_id, len(s.token_ids)) for s in out.seqs] == [("r0", 1), ("r1", 1)]
    out = h.step()  # r0 and r1 finished last step and left at once: r2 is admitted
    assert [s.request_id for s in out.seqs] == ["r2"]


def test_the_prompts_of_one_api_request_take_turns_with_later_requests():
    """Issue 51 item 3: one request's 16,000 sequences went wholly before a stream that arrived
    2 s later (its first token after 95 s). A request of many prompts now takes turns: a request
    arriving after it waits for its first prompt, not all of them; requests of one prompt keep
    their arrival order, and a preempted group still goes first."""
    h = Harness(max_num_seqs=1, max_tokens_per_step=64)
    for i in range(5):
        group = make_sequence_group(f"big-{i}", [1, 2, 3], SamplingParams(max_tokens=1, temperature=0), h.requests, 1.0)
        group.api_request_id = "big"
        h.add_group(group)
    h.add("late", prompt_len=3, max_tokens=1)
    h.add("later", prompt_len=3, max_tokens=1)
    assert [g.request_id for g in h.scheduler.waiting] == ["big-0", "late", "later", "big-1", "big-2", "big-3", "big-4"]
    admitted = [out.seqs[0].request_id for out in h.run() if out.seqs]
    assert admitted == ["big-0", "late", "later", "big-1", "big-2", "big-3", "big-4"]
    h2 = Harness(max_num_seqs=4)
    for i in range(3):
        group = make_sequence_group(f"a-{i}", [1, 2, 3], SamplingParams(max_tokens=1, temperature=0), h2.requests, 1.0)
        group.api_request_id = "a"
        h2.add_group(group)
    preempted = make_sequence_group("back", [1, 2], SamplingParams(max_tokens=1, temperature=0), h2.requests, 0.5)
    h2.scheduler.waiting.appendleft(preempted)
    preempted.turn = -1  # as _preempt leaves it
    h2.add("new", prompt_len=3, max_tokens=1)
    assert [g.request_id for g in h2.scheduler.waiting] == ["back", "a-0", "new", "a-1", "a-2"]


def test_an_api_request_of_many_prompts_leaves_a_seat_for_a_later_request():
    """However long its prompts decode, an API request of many prompts holds at most all but an
    eighth of max_num_seqs: a request arriving later is admitted in the next step, not after
    one of them finishes. A request of one prompt with many samples is not limited."""
    h = Harness(max_num_seqs=8, max_tokens_per_step=256)
    for i in range(8):
        group = make_sequence_group(f"big-{i}", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0), h.requests, 1.0)
        group.api_request_id = "big"
        h.add_group(group)
    first = h.step()
    assert sorted(s.request_id for s in first.seqs) == [f"big-{i}" for i in range(7)]
    h.add("late", prompt_len=3, max_tokens=2)
    assert "late" in [s.request_id for s in h.step().seqs]
    alone = Harness(max_num_seqs=8)
    alone.add_group(make_sequence_group("n8", [1, 2, 3], SamplingParams(n=8, max_tokens=5, temperature=1.0, seed=1),
                                        alone.requests, 1.0))
    alone.step()
    alone.step()
    assert len(alone.groups["n8"].unfinished_seqs()) == 8


def test_running_decodes_and_new_prompts_share_a_step():
    h = Harness()
    h.add("a", prompt_len=5, max_tokens=10)
    h.step()
    h.add("b", prompt_len=6, max_tokens=10)
    out = h.step()
    assert [(s.request_id, s.start_position, len(s.token_ids)) for s in out.seqs] == [("a", 5, 1), ("b", 0, 6)]


def test_long_prompt_is_chunked_under_the_token_budget():
    h = Harness(max_tokens_per_step=8, block_size=4)
    h.add("long", prompt_len=20, max_tokens=1)
    chunks = []
    for _ in range(3):
        (item,) = h.step().seqs
        chunks.append((item.start_position, len(item.token_ids), item.num_samples))
    assert chunks == [(0, 8, 0), (8, 8, 0), (16, 4, 1)]  # samples only when the prompt is done


def test_control_message_positions_and_block_tables_cover_the_new_tokens():
    h = Harness(block_size=4)
    h.add("a", prompt_len=9, max_tokens=3)
    (item,) = h.step().seqs
    assert len(item.block_table) == 3  # ceil(9 / 4), allocated on demand, not for max length
    (item,) = h.step().seqs
    assert (item.start_position, item.token_ids) == (9, [7])
    assert len(item.block_table) == 3  # slot 9 fits in the third block
    assert len(set(item.block_table)) == 3


def test_preemption_evicts_latest_arrival_and_recomputes_prompt_plus_outputs():
    # 6 blocks of 4 tokens: two requests of 8 prompt tokens each take 4 blocks; as they decode,
    # they need a fifth and sixth block, then a seventh: the later one must give way.
    h = Harness(num_blocks=6, block_size=4)
    h.add("early", prompt_len=8, max_tokens=8)
    h.add("late", prompt_len=8, max_tokens=8)
    preempted_step = None
    for step in range(30):
        out = h.step()
        if h.scheduler.stats.num_preemptions and preempted_step is None:
            preempted_step = step
            late = h.groups["late"].seqs[0]
            assert late.status is SequenceStatus.WAITING and not h.bm.has_blocks(late.seq_id)
            assert [s.request_id for s in out.seqs] == ["early"]
            generated = late.num_output_tokens
            assert generated > 0
        if preempted_step is not None and any(s.request_id == "late" for s in out.seqs):
            (item,) = [s for s in out.seqs if s.request_id == "late"]
            # Resumed as one prefill of the prompt and everything generated so far.
            assert item.start_position == 0
            assert item.token_ids == list(range(1, 9)) + [7] * generated
            break
    assert preempted_step is not None
    assert h.scheduler.stats.num_recompute_preemptions >= 1
    h.run()
    assert h.bm.num_free_blocks == h.bm.num_total_blocks


def test_every_request_finishes_and_all_blocks_return_under_pressure():
    h = Harness(num_blocks=12, block_size=2, max_num_seqs=6, max_tokens_per_step=16)
    for i in range(10):
        h.add(f"r{i}", prompt_len=3 + i % 5, max_tokens=4 + i % 3)
    h.run()
    assert h.scheduler.stats.num_preemptions > 0
    assert all(g.is_finished for g in h.groups.values())
    assert all(g.seqs[0].num_output_tokens == 4 + int(g.request_id[1:]) % 3 for g in h.groups.values())
    assert h.bm.num_free_blocks == h.bm.num_total_blocks


def test_swap_mode_swaps_out_and_brings_back_before_new_prompts():
    h = Harness(num_blocks=6, block_size=4, cpu_blocks=6, mode="swap")
    h.add("early", prompt_len=8, max_tokens=8)
    h.add("late", prompt_len=8, max_tokens=8)
    swapped_seen = False
    for _ in range(40):
        h.step()
        if h.scheduler.swapped:
            swapped_seen = True
            late = h.groups["late"].seqs[0]
            assert late.status is SequenceStatus.SWAPPED and late.num_computed_tokens > 0
            h.add("newcomer", prompt_len=2, max_tokens=1)
            break
    assert swapped_seen and h.scheduler.stats.num_swap_preemptions == 1
    order = []
    while h.scheduler.has_unfinished():
        out = h.step()
        order += [s.request_id for s in out.seqs if s.request_id not in order]
    assert order.index("late") < order.index("newcomer")
    late = h.groups["late"].seqs[0]
    assert late.num_output_tokens == 8
    assert h.bm.num_free_blocks == h.bm.num_total_blocks
    assert h.bm.cpu_pool.num_free_blocks == h.bm.cpu_pool.num_blocks


def test_abort_releases_blocks_immediately():
    h = Harness()
    h.add("a", prompt_len=10, max_tokens=50)
    h.add("b", prompt_len=10, max_tokens=50)
    h.step()
    free_before = h.bm.num_free_blocks
    group = h.scheduler.abort("a")
    assert group is not None and group.seqs[0].status is SequenceStatus.FINISHED_ABORTED
    assert h.bm.num_free_blocks > free_before
    assert h.scheduler.abort("missing") is None
    assert [s.request_id for s in h.step().seqs] == ["b"]


def test_group_that_can_never_fit_fails_instead_of_waiting_forever():
    h = Harness(num_blocks=4, block_size=2)
    seqs = [Sequence(100 + i, [1, 2, 3, 4, 5]) for i in range(3)]  # 3 sequences x 3 blocks > 4 blocks
    group = SequenceGroup("big", seqs, SamplingParams(n=3, temperature=1.0), arrival_time=0.0)
    group.forked = True
    h.scheduler.add(group)
    h.add("small", prompt_len=3, max_tokens=1)
    out = h.scheduler.schedule()
    failed = h.scheduler.take_failed()
    assert failed == [group] and "cannot be scheduled" in group.error
    assert all(s.status is SequenceStatus.FINISHED_ERROR for s in seqs)
    assert [s.request_id for s in out.seqs] == ["small"]


@pytest.mark.parametrize("budget", [3, 5])
def test_group_of_several_sequences_samples_together(budget):
    """Sequences of one group hold back their last token until all can compute it in one step."""
    h = Harness(max_tokens_per_step=budget, block_size=2)
    seqs = [Sequence(200 + i, [1, 2, 3, 4]) for i in range(2)]
    group = SequenceGroup("pair", seqs, SamplingParams(n=2, temperature=1.0, max_tokens=2), arrival_time=0.0)
    group.forked = True
    h.add_group(group)
    for _ in range(10):
        out = h.step()
        sampled = {s.seq_id for s in out.seqs if s.num_samples}
        assert sampled in (set(), {200, 201})
        if group.is_finished:
            break
    assert group.is_finished
