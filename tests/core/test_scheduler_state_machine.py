"""Random add / step / abort sequences against the Scheduler and a real BlockManager: budgets, FCFS, KV contents, no hangs, no leaks;
with speculating sequences (proposed tokens verified, the rejected ones rolled back) in some runs.

A little over 400 lines: the stand-in engine and simulated KV memory the machine needs, the
machine, and its findings kept as fixed examples, which belong beside it."""

from __future__ import annotations

from types import SimpleNamespace

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedllm.config import SchedulerConfig
from pagedllm.core import BlockManager, Scheduler, SchedulerOutput, Sequence, SequenceGroup, SequenceStatus
from pagedllm.core.model_output import ModelRunnerOutput, SampledToken, SequenceStepOutput
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.requests import RequestRegistry, make_sequence_group
from pagedllm.sampling_params import SamplingParams
from tests.engine.fakes import FakeTokenizer

# Stepping a drained-down machine this long without any token sampled, request finished or
# request failed is a hang (the slowest honest progress, a prompt chunked one token a step after
# a preemption, takes a few dozen steps).
MAX_STEPS_WITHOUT_PROGRESS = 200
MAX_DRAIN_STEPS = 2000


def sampled_token(seq: Sequence, ahead: int = 0) -> int:
    """The stand-in model's choice: from the prompts' small alphabet, different per sample stream,
    so parallel samples diverge (copy-on-write) and prompts often share prefixes (cache hits).
    `ahead`: its choice that many tokens later."""
    return (seq.sample_index + seq.num_output_tokens + ahead) % 3


class StandInEngine:
    """The engine's own `EngineCore` and output processing over a stand-in model, which carries
    out the control message on a simulated KV memory (each slot remembers the token written
    there) and draws `sampled_token`s; a stand-in proposer suggests tokens to verify. A sequence
    finishes after its request's max_tokens."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        num_cpu_blocks: int = 0,
        mode: str = "recompute",
        max_num_seqs: int = 4,
        max_num_batched_tokens: int = 16,
        caching: bool = False,
        watermark: float = 0.0,
        swap_cost_per_block: float = 1.0,
        group_windows: tuple[int | None, ...] = (None,),
        num_speculative_tokens: int = 0,
    ) -> None:
        # Speculative decoding: each step, every decoding sequence proposes up to this many tokens,
        # the model's own next tokens except one wrong token at a varying place (so acceptance
        # varies from none to all), as the engine's proposer would set them.
        self.num_speculative_tokens = num_speculative_tokens
        self.num_accepted = 0
        self.bm = BlockManager(
            block_size, num_blocks, num_cpu_blocks, enable_prefix_caching=caching, watermark=watermark,
            group_windows=group_windows,
        )
        self.group_windows = group_windows
        self.config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            preemption_mode=mode,
            watermark=watermark,
            swap_cost_per_block=swap_cost_per_block,
            recompute_cost_per_token=1.0,
        )
        self.scheduler = Scheduler(self.config, self.bm)
        self.block_size = block_size
        self.device = {b: [None] * block_size for b in range(num_blocks)}
        self.cpu = {b: [None] * block_size for b in range(num_cpu_blocks)}
        self.requests = RequestRegistry()
        self.seqs = self.requests.seqs  # the live sequences
        processor = OutputProcessor(FakeTokenizer(), self.requests, max_model_len=10**6, eos_token_ids=[])
        speculator = self if num_speculative_tokens else None
        self.core = EngineCore(self.scheduler, self, processor.process, self.requests, speculator=speculator)
        self.groups: dict[str, SequenceGroup] = {}  # every request added, finished or not
        self.failed: dict[str, SequenceGroup] = {}
        self._inspect = None
        self._clock = 0.0

    def add(self, prompt: list[int], max_tokens: int, best_of: int = 1, n: int | None = None) -> SequenceGroup:
        params = SamplingParams(n=best_of if n is None else n, best_of=best_of, temperature=1.0, max_tokens=max_tokens)
        self._clock += 1.0
        group = make_sequence_group(f"r{len(self.groups)}", prompt, params, self.requests, self._clock)
        self.groups[group.request_id] = group
        self.core.add(group)
        return group

    def step(self, inspect=None) -> SchedulerOutput:
        """One engine step; `inspect(output)` sees the control message before anything runs."""
        self._inspect = inspect
        step = self.core.step()
        self.failed.update((group.request_id, group) for group in step.failed)
        return step.scheduled or SchedulerOutput()

    # --- the stand-in model (the core's executor) --------------------------------------------

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self._inspect is not None:
            self._inspect(out)
        self._carry_out(out)
        result = ModelRunnerOutput()
        for item in out.seqs:
            self._write(item)
            if not item.num_samples:
                continue
            seq = self.seqs[item.seq_id]
            accepted = []
            for j, token in enumerate(item.draft_token_ids):
                if token != sampled_token(seq, ahead=j):
                    break
                accepted.append(SampledToken(token, -1.0))
            assert seq.num_output_tokens + len(accepted) < self.groups[item.request_id].sampling_params.max_tokens
            self.num_accepted += len(accepted)
            # A completed parallel-sampling prompt draws one token per sample stream.
            samples = [SampledToken((sampled_token(seq, ahead=len(accepted)) + i) % 3, -1.0) for i in range(item.num_samples)]
            result.outputs[item.seq_id] = SequenceStepOutput(samples=samples, accepted=accepted)
        return result

    # --- the stand-in proposer (the core's speculator) ---------------------------------------

    config = SimpleNamespace(adaptive=False)

    def propose(self, scheduler: Scheduler, prompt_chunk_limit: int | None) -> dict[int, list[int]]:
        k, drafts = self.num_speculative_tokens, {}
        for group in scheduler.running:
            for seq in group.unfinished_seqs():
                room = min(k, group.sampling_params.max_tokens - seq.num_output_tokens - 1)
                if seq.num_uncomputed_tokens != 1 or room <= 0 or not (group.forked or group.sampling_params.best_of == 1):
                    continue
                wrong = (seq.seq_id + seq.num_output_tokens) % (k + 1)
                drafts[seq.seq_id] = [(sampled_token(seq, j) + (j == wrong)) % 3 for j in range(room)]
        return drafts

    def fill(self, scheduled, seqs) -> None: ...

    def observe(self, scheduled, result, seconds) -> None: ...

    def running_ids(self) -> list[str]:
        return [g.request_id for g in self.scheduler.running]

    def progress(self) -> tuple[int, int, int]:
        tokens = sum(s.num_output_tokens for g in self.groups.values() for s in g.seqs)
        finished = sum(1 for g in self.groups.values() if g.is_finished)
        return tokens, finished, len(self.failed)

    def _carry_out(self, out: SchedulerOutput) -> None:
        """What each worker does before the model runs: swap out, swap in, copy (the worker's order)."""
        for dev, cpu in out.blocks_to_swap_out:
            self.cpu[cpu] = list(self.device[dev])
        for cpu, dev in out.blocks_to_swap_in:
            self.device[dev] = list(self.cpu[cpu])
        for src, dst in out.blocks_to_copy:
            self.device[dst] = list(self.device[src])

    def _write(self, item) -> None:
        """Each KV cache group's layers write into that group's blocks (tokens tagged with it)."""
        for group, table in enumerate(item.block_tables):
            for offset, token in enumerate(item.token_ids):
                pos = item.start_position + offset
                block = table[pos // self.block_size]
                assert block is not None, f"sequence {item.seq_id} writes position {pos} into a freed entry"
                assert self.bm.ref_count(block) == 1, f"sequence {item.seq_id} writes position {pos} into shared block {block}"
                self.device[block][pos % self.block_size] = (group, token)

    def read(self, memory, table, group: int, begin: int, end: int) -> list:
        """The tokens at positions [begin, end) through one group's table."""
        stored = []
        for p in range(begin, end):
            written = memory[table[p // self.block_size]][p % self.block_size]
            assert written is None or written[0] == group, f"position {p} reads another group's keys"
            stored.append(None if written is None else written[1])
        return stored


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.integers(1, 4),
        num_blocks=st.integers(3, 12),
        num_cpu_blocks=st.sampled_from([0, 4, 8, 16]),
        mode=st.sampled_from(["recompute", "swap", "swap", "auto"]),
        max_num_seqs=st.integers(1, 4),
        extra_budget=st.integers(0, 12),
        caching=st.booleans(),
        watermark=st.sampled_from([0.0, 0.0, 0.2]),
        swap_cost_per_block=st.sampled_from([0.5, 0.5, 4.0]),  # auto: swap when blocks * cost < tokens
        # A plain model, every layer sliding (Mistral), and a hybrid of full and windowed layers.
        group_windows=st.sampled_from([(None,), (None,), (3,), (None, 2)]),
        num_speculative_tokens=st.sampled_from([0, 0, 1, 3]),
    )
    def setup(self, block_size, num_blocks, num_cpu_blocks, mode, max_num_seqs, extra_budget, caching, watermark,
              swap_cost_per_block, group_windows, num_speculative_tokens):
        self.engine = StandInEngine(
            block_size,
            num_blocks,
            num_cpu_blocks,
            mode=mode,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_seqs + extra_budget,  # the engine requires >= max_num_seqs
            caching=caching,
            watermark=watermark,
            swap_cost_per_block=swap_cost_per_block,
            group_windows=group_windows,
            num_speculative_tokens=num_speculative_tokens,
        )
        self.bm = self.engine.bm
        self.sched = self.engine.scheduler
        self.config = self.engine.config
        self.bs = block_size
        self.prompts: list[list[int]] = []
        self.aborted: set[str] = set()

    # --- rules -------------------------------------------------------------------------------

    @rule(
        tail=st.lists(st.integers(0, 2), min_size=0, max_size=10),
        share_from=st.none() | st.integers(0, 1000),
        keep=st.integers(1, 12),
        max_tokens=st.integers(1, 8),
        best_of=st.sampled_from([1, 1, 1, 2, 3]),
        n_below_best_of=st.booleans(),
    )
    def add_request(self, tail, share_from, keep, max_tokens, best_of, n_below_best_of):
        prefix = []
        if share_from is not None and self.prompts:
            prefix = self.prompts[share_from % len(self.prompts)][:keep]
        prompt = (prefix + tail) or [0]
        best_of = min(best_of, self.config.max_num_seqs)  # the engine rejects best_of > max_num_seqs
        self.engine.add(prompt, max_tokens, best_of=best_of, n=1 if n_below_best_of else best_of)
        self.prompts.append(prompt)

    @rule(num_steps=st.integers(1, 3))
    def step(self, num_steps):
        for _ in range(num_steps):
            self._step()

    @rule(i=st.integers(0, 1000))
    def abort(self, i):
        if not self.engine.groups:
            return
        request_id = list(self.engine.groups)[i % len(self.engine.groups)]
        group = self.engine.core.abort(request_id)
        if group is None:
            return
        event("abort of a live request")
        self.aborted.add(request_id)
        assert group.is_finished
        assert not any(self.bm.has_blocks(s.seq_id) for s in group.seqs), "an aborted request kept device blocks"
        assert not set(self.bm.live_cpu_tables()) & {s.seq_id for s in group.seqs}, "an aborted request kept CPU blocks"

    def _step(self) -> None:
        waiting_before = list(self.sched.waiting)
        num_failed = len(self.engine.failed)
        hits, recomputes = self.bm.prefix_hits, self.sched.stats.num_recompute_preemptions

        def inspect(out: SchedulerOutput) -> None:
            self._check_fcfs_admission(waiting_before)
            self._check_budget(out)
            self._check_block_tables_cover_positions(out)

        accepted = self.engine.num_accepted
        out = self.engine.step(inspect)
        for name, happened in (
            ("speculating sequence", any(item.draft_token_ids for item in out.seqs)),
            ("proposed tokens accepted", self.engine.num_accepted > accepted),
            ("swap out", out.blocks_to_swap_out),
            ("swap in", out.blocks_to_swap_in),
            ("copy-on-write", out.blocks_to_copy),
            ("a request failed", len(self.engine.failed) > num_failed),
            ("prefix-cache hit", self.bm.prefix_hits > hits),
            ("preemption by recomputation", self.sched.stats.num_recompute_preemptions > recomputes),
        ):
            if happened:
                event(name)

    # --- per-step checks ---------------------------------------------------------------------

    def _check_fcfs_admission(self, waiting_before: list[SequenceGroup]) -> None:
        """Failed groups have left `waiting`; any other group still there must have arrived after
        every group admitted from it in this step."""
        admitted = [g for g in waiting_before if any(g is r for r in self.sched.running)]
        for group in admitted:
            for other in self.sched.waiting:
                assert other.arrival_time > group.arrival_time, (
                    f"{group.request_id} (arrived {group.arrival_time}) was admitted while "
                    f"{other.request_id} (arrived {other.arrival_time}) still waits"
                )

    def _check_budget(self, out: SchedulerOutput) -> None:
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len(out.seqs) <= self.config.max_num_seqs, f"{len(out.seqs)} sequences scheduled in one step"

    def _check_block_tables_cover_positions(self, out: SchedulerOutput) -> None:
        for item in out.seqs:
            seq = self.engine.seqs[item.seq_id]
            end = item.start_position + item.num_tokens
            own = item.num_tokens - len(item.draft_token_ids)  # proposed tokens come after its own
            assert own > 0
            assert item.start_position == seq.num_computed_tokens
            assert item.token_ids[:own] == seq.token_ids[item.start_position : item.start_position + own]
            assert item.token_ids[own:] == item.draft_token_ids == seq.draft_token_ids
            assert not item.draft_token_ids or (own == 1 and item.num_samples == 1)
            assert len(item.block_table) * self.bs >= end, f"block table of {seq.seq_id} ends before position {end - 1}"
            assert item.block_tables == self.bm.block_tables(seq.seq_id)

    # --- invariants --------------------------------------------------------------------------

    @invariant()
    def block_manager_invariants_hold(self):
        if hasattr(self, "bm"):
            self.bm.check_invariants()

    @invariant()
    def running_and_swapped_queues_are_in_arrival_order(self):
        if not hasattr(self, "sched"):
            return
        for name, queue in (("running", self.sched.running), ("swapped", self.sched.swapped)):
            arrivals = [g.arrival_time for g in queue]
            assert arrivals == sorted(arrivals), f"{name} queue out of arrival order: {[g.request_id for g in queue]}"

    @invariant()
    def running_sequences_within_max_num_seqs(self):
        if hasattr(self, "sched"):
            running = self.sched.num_running_seqs
            assert running <= self.config.max_num_seqs, f"{running} sequences running, max_num_seqs={self.config.max_num_seqs}"

    @invariant()
    def kv_cache_holds_every_live_sequences_computed_tokens(self):
        if not hasattr(self, "bm"):
            return
        for memory, live, tables_of in (
            (self.engine.device, self.bm.live_tables(), self.bm.block_tables),
            (self.engine.cpu, self.bm.live_cpu_tables(), self.bm.cpu_block_tables),
        ):
            for seq_id in live:
                seq = self.engine.seqs[seq_id]
                c = seq.num_computed_tokens
                for group, (window, table) in enumerate(zip(self.engine.group_windows, tables_of(seq_id))):
                    seen = c if window is None else min(c, window - 1)  # what the next token sees
                    stored = self.engine.read(memory, table, group, c - seen, c)
                    assert stored == seq.token_ids[c - seen : c], f"sequence {seq_id} reads back wrong KV"

    def _check_invariants(self) -> None:
        self.block_manager_invariants_hold()
        self.running_and_swapped_queues_are_in_arrival_order()
        self.running_sequences_within_max_num_seqs()
        self.kv_cache_holds_every_live_sequences_computed_tokens()

    # --- the end: nothing hangs, nothing leaks -----------------------------------------------

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        last_progress, idle = self.engine.progress(), 0
        for _ in range(MAX_DRAIN_STEPS):
            if not self.sched.has_unfinished() or idle >= MAX_STEPS_WITHOUT_PROGRESS:
                break
            self._step()
            self._check_invariants()
            progress = self.engine.progress()
            idle = 0 if progress != last_progress else idle + 1
            last_progress = progress
        assert not self.sched.has_unfinished(), (
            f"a hang: {[g.request_id for g in self.sched.waiting]} waiting, {self.engine.running_ids()} running, "
            f"{[g.request_id for g in self.sched.swapped]} swapped, no progress in {idle} steps"
        )
        capacity = self.bm.num_total_blocks - self.bm.watermark_blocks
        for request_id, group in self.engine.groups.items():
            params = group.sampling_params
            if request_id in self.engine.failed:
                assert group.error and "cannot be scheduled" in group.error
                assert all(s.status is SequenceStatus.FINISHED_ERROR for s in group.seqs if s.status is not SequenceStatus.FINISHED_LENGTH)
                # Failing is right only for a request that cannot fit alone even with a private
                # copy of every block (a recomputed group loses its sharing).
                failed_seqs = group.seqs_with_status(SequenceStatus.FINISHED_ERROR)
                budget = self.config.max_num_batched_tokens
                needed = sum(self.bm.max_blocks_of_sequence(s.num_tokens, budget) for s in failed_seqs)
                assert needed > capacity, f"{request_id} failed though its {needed} blocks fit in {capacity}"
            elif request_id in self.aborted:
                assert group.is_finished
            else:
                assert len(group.seqs) == params.best_of
                for seq in group.seqs:
                    assert seq.status is SequenceStatus.FINISHED_LENGTH
                    assert seq.num_output_tokens == params.max_tokens
        assert self.bm.live_tables() == {} and self.bm.live_cpu_tables() == {}
        assert self.bm.num_free_blocks == self.bm.num_total_blocks, "device blocks leaked"
        assert self.bm.num_free_cpu_blocks == self.bm.num_cpu_blocks, "CPU blocks leaked"


SchedulerMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    report_multiple_bugs=False,  # shrinking one failure at a time keeps a failing run short
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase


# --- the machine's findings, as fixed examples ----------------------------------------------


def test_parallel_sampling_request_holds_best_of_seats_before_it_forks():
    """r0 completes its prompt in the first step and forks into 2 sequences then, so with
    max_num_seqs=2 it occupies both seats: r1 must wait."""
    engine = StandInEngine(block_size=4, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=8)
    engine.add([0, 1, 2], max_tokens=4, best_of=2)
    engine.add([1, 2, 0], max_tokens=4)
    out = engine.step()
    assert [s.request_id for s in out.seqs] == ["r0"]


def test_parallel_sampling_request_that_outgrows_the_device_fails_instead_of_cycling():
    """Two samples of a 4-token prompt, 8 tokens each, in 14 one-token blocks: even sharing the
    prompt they need 4 + 2 * 8 = 20 blocks, so the request can never finish and must fail
    (with a prompt chunk that fits, it must not be admitted and preempted again and again)."""
    engine = StandInEngine(block_size=1, num_blocks=14, max_num_seqs=2, max_num_batched_tokens=12)
    engine.add([0, 1, 2, 0], max_tokens=8, best_of=2)
    for _ in range(50):
        if not engine.scheduler.has_unfinished():
            break
        engine.step()
    assert list(engine.failed) == ["r0"]


def test_recomputed_group_rejoins_running_in_arrival_order_after_a_newer_swapped_one():
    """One-token blocks, 8 on the device and 1 on the CPU. r0 (5-token prompt, 2 outputs),
    r1 (1-token prompt, 2 samples sharing its block) and r2 (1-token prompt) all start in step 1,
    leaving 1 block free. In step 2 r0 takes it for its last token; r1 needs 2 more, so r2
    (newest) is swapped out to the one CPU block, which frees only 1, so r1 is preempted too, by
    recomputation (no CPU room). r0 finishes. In step 3 r2 swaps back in and r1 is re-admitted:
    r1 arrived first, so it must run ahead of r2 (and be the last to be preempted)."""
    engine = StandInEngine(block_size=1, num_blocks=8, num_cpu_blocks=1, mode="swap", max_num_batched_tokens=16)
    engine.add([0, 0, 0, 0, 0], max_tokens=2)
    engine.add([1], max_tokens=3, best_of=2)
    engine.add([2], max_tokens=3)
    engine.step()
    engine.step()
    assert [g.request_id for g in engine.scheduler.swapped] == ["r2"]
    assert [g.request_id for g in engine.scheduler.waiting] == ["r1"]
    engine.step()
    assert engine.running_ids() == ["r1", "r2"]


def test_block_shared_by_every_sample_needs_one_copy_fewer_than_its_sharers():
    """Three samples fork from a 1-token prompt and share its 2-token block; each then writes
    position 1 there. The first two copy the block and the third writes it in place, so 2 free
    blocks suffice: nothing is preempted."""
    engine = StandInEngine(block_size=2, num_blocks=3, max_num_seqs=3, max_num_batched_tokens=8)
    engine.add([0], max_tokens=3, best_of=3)
    engine.step()
    assert engine.bm.num_free_blocks == 2
    out = engine.step()
    assert engine.scheduler.stats.num_preemptions == 0
    assert len(out.blocks_to_copy) == 2


def test_swapped_group_whose_shared_block_needs_copies_for_all_but_one_sharer_is_swapped_back_in():
    """Two-token blocks, 3 on the device. r1's 3 samples share the block of its 1-token prompt;
    each must write position 1 there, so it is swapped out while r0 runs. Once r0 is done, r1
    needs that block back plus 2 copies (the third sharer writes in place): 3 blocks, all the
    device has, so it resumes rather than failing."""
    engine = StandInEngine(block_size=2, num_blocks=3, num_cpu_blocks=4, mode="swap", max_num_batched_tokens=8)
    engine.add([0], max_tokens=5)
    engine.add([1], max_tokens=2, best_of=3)
    for _ in range(30):
        if not engine.scheduler.has_unfinished():
            break
        engine.step()
    assert engine.scheduler.stats.num_swap_preemptions == 1
    assert list(engine.failed) == []
