"""First-come-first-served, iteration-level scheduler over a token budget.

Every step, in this order:
1. Running groups, oldest first, get the tokens they still need (one per decoding sequence, a
   chunk of the prompt for a prompt being computed). When blocks run out, the most recently
   arrived running group is preempted, all of its sequences together, until the older one fits;
   a group that does not fit even alone (samples or beams outgrowing the device) fails (a safety
   net: the engine refuses at admission any request whose sequences could outgrow the cache).
2. Swapped-out groups come back, oldest first, if nothing was preempted in this step.
3. Waiting groups (new prompts, and groups preempted by recomputation, which rejoin the queue's
   front) are admitted in queue order, while the token budget, `max_num_seqs` and the free
   blocks (minus a small watermark) allow. The queue is first come, first served, except that
   the prompts of one API request of many take turns with other requests and hold at most a
   share of the seats (`pagedllm.core.turns`). A prompt longer than the remaining budget is
   computed in chunks over several steps.

A group of several sequences (parallel samples, beams) is gang-scheduled: its sequences are
preempted and resumed together, and they sample in the same step. After the step,
`update_from_output` applies its outcome; nothing else writes the block tables.

A pooling (embedding) request is a prompt-only group: its chunks are scheduled as any prompt's
(chunked, preempted, swapped alike) but sample nothing (`num_samples` 0) and carry the pooling
type for the driver; output processing ends it in the step its prompt completes, and its blocks
are freed in that same step. It takes its cached prefix only when pooling the last token: MEAN
and CLS need every prompt position's hidden state, as prompt log-probabilities do. Its full
blocks are published to the prefix cache either way (they hold the same keys and values as a
generation request's would), so later requests with the same prefix reuse them.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.kv_breakdown import KVBreakdownAverage
from pagedllm.core.model_output import ModelRunnerOutput
from pagedllm.core.preemption import PreemptionMode, choose_preemption_mode
from pagedllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.core.step_update import ProcessOutput, StepUpdate
from pagedllm.core.turns import PREEMPTED_TURN, over_share, queue_in_turn
from pagedllm.pooling_params import PoolingType
from pagedllm.sampling_params import SamplingType


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_recompute_preemptions: int = 0
    num_swap_preemptions: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0


@dataclass
class _Step:
    """What one `schedule()` call has decided so far, handed from phase to phase."""

    budget: int  # tokens still allowed this step
    # Prompt (prefill) tokens still allowed this step under the step-time budget (None: no cap).
    prompt_budget: int | None = None
    # Plain prompt tokens of `prompt_budget` that one prompt token with log-probabilities takes
    # (its row of the LM head and a pass over the vocabulary cost more).
    logprob_price: float = 1.0
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: bool = False  # a running group was preempted: nothing else is admitted


def _wants_prompt_logprobs(group: SequenceGroup, seq: Sequence) -> bool:
    return group.sampling_params.prompt_logprobs is not None and seq.num_output_tokens == 0


def _needs_every_position(group: SequenceGroup) -> bool:
    """A pooling request whose vector reads every prompt position (MEAN), or the first (CLS)."""
    pooling = group.pooling_params
    return pooling is not None and pooling.pooling_type is not PoolingType.LAST


def _has_drafts(group: SequenceGroup) -> bool:
    return any(seq.draft_token_ids for seq in group.unfinished_seqs())


class Scheduler:
    """The only writer of the block tables: it allocates, preempts, swaps and frees while
    scheduling, and applies each step's forks, drops and stops (`update_from_output`)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, share_blocks: bool = True) -> None:
        self.config = config
        self.block_manager = block_manager
        # Off only to measure what sharing saves: forks then copy every block.
        self.share_blocks = share_blocks
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []  # in arrival order
        self.swapped: list[SequenceGroup] = []  # in arrival order
        self.stats = SchedulerStats()
        # What the device's KV slots held (token states, reserved, fragmented, free), summed
        # over the steps, one sample at the end of each (`_free_finished`).
        self.kv_breakdown = KVBreakdownAverage()
        self._finished_request_ids: list[str] = []
        self._failed: list[SequenceGroup] = []

    # --- request lifecycle ------------------------------------------------------------------

    def add(self, group: SequenceGroup) -> None:
        """Queue a new group, in turn with the other API requests' (`pagedllm.core.turns`)."""
        group.set_status(SequenceStatus.WAITING)
        queue_in_turn(self.waiting, group)

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Stop a request wherever it is and free its blocks at once."""
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    for seq in group.unfinished_seqs():
                        seq.status = SequenceStatus.FINISHED_ABORTED
                    self._free_group(group)
                    return group
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_running_seqs(self) -> int:
        return sum(g.num_unfinished_seqs for g in self.running)

    @staticmethod
    def _seats(group: SequenceGroup) -> int:
        """Seats of `max_num_seqs` the group holds: every sample or beam it will run, from its
        admission on (a parallel-sampling prompt forks into `best_of` sequences when it completes)."""
        if group.forked:
            return group.num_unfinished_seqs
        return max(group.num_unfinished_seqs, group.sampling_params.best_of)

    def _num_seats_taken(self) -> int:
        return sum(self._seats(g) for g in self.running)

    def take_failed(self) -> list[SequenceGroup]:
        """Groups the scheduler had to give up on (they can never fit), since the last call."""
        failed, self._failed = self._failed, []
        return failed

    # --- scheduling -------------------------------------------------------------------------

    def schedule(self, prompt_chunk_limit: int | None = None, logprob_price: float = 1.0) -> SchedulerOutput:
        """Decide the next step, in the three phases of the module docstring.
        `prompt_chunk_limit`: the most prompt tokens the step computes while other requests share
        the engine (the step-time budget, `pagedllm.engine.step_budget`); None: no cap. A prompt
        token whose log-probabilities are computed counts `logprob_price` tokens of it."""
        step = _Step(budget=self.config.max_num_batched_tokens, logprob_price=max(1.0, logprob_price))
        if prompt_chunk_limit is not None and len(self.running) + len(self.waiting) + len(self.swapped) > 1:
            step.prompt_budget = prompt_chunk_limit  # alone, a request holds nobody up
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_swapped(step)
        if not step.preempted and not self.swapped:
            self._schedule_waiting(step)
        cache_ops = self.block_manager.drain_pending()
        finished, self._finished_request_ids = self._finished_request_ids, []
        return SchedulerOutput(
            seqs=step.scheduled,
            blocks_to_swap_out=cache_ops.swap_out,
            blocks_to_swap_in=cache_ops.swap_in,
            blocks_to_copy=cache_ops.copies,
            finished_request_ids=finished,
        )

    def requeue_finished(self, request_ids: list[str]) -> None:
        """Finished requests a step's message carried but the workers may not have seen (the step
        failed): they go out again with the next step, so workers drop their state for them."""
        self._finished_request_ids[:0] = request_ids

    def _schedule_running(self, step: _Step) -> None:
        """Running groups, oldest first; preempt from the newest end when blocks run out."""
        index = 0
        while index < len(self.running):
            group = self.running[index]
            plan = self._plan_tokens(group, step.budget, prompt_budget=self._prompt_budget(group, step), speculate=True)
            if plan is None:
                index += 1
                continue
            needed = self.block_manager.blocks_needed_together(plan)
            if not self.block_manager.can_allocate(needed) and _has_drafts(group):
                # Proposals are dropped rather than preempt anything for them.
                for seq in group.unfinished_seqs():
                    seq.draft_token_ids = []
                plan = self._plan_tokens(group, step.budget)
                needed = self.block_manager.blocks_needed_together(plan)
            while not self.block_manager.can_allocate(needed):
                if self.running == [group]:  # nothing else holds device blocks: it can never fit
                    self.running.pop()
                    self._fail(group, "its sequences need more KV cache blocks than the device has")
                    break
                victim = self.running.pop()
                self._preempt(victim)
                step.preempted = True
                if victim is group:
                    break
            else:
                self._allocate_and_emit(group, plan, step)
                index += 1

    def _schedule_swapped(self, step: _Step) -> None:
        """Swapped groups come back oldest first, before any new prompt."""
        bm = self.block_manager
        while self.swapped:
            group = self.swapped[0]
            seqs = group.unfinished_seqs()
            if len(seqs) > step.budget or self._num_seats_taken() + self._seats(group) > self.config.max_num_seqs:
                return
            needed = bm.swap_in_blocks_needed(seqs)
            if not bm.can_allocate(needed, keep_watermark=True):
                if not self.running and needed > bm.num_total_blocks - bm.watermark_blocks:
                    self.swapped.pop(0)
                    self._fail(group, "its sequences need more KV cache blocks than the device has")
                    continue
                return
            self.swapped.pop(0)
            self.stats.num_blocks_swapped_in += bm.swap_in(seqs)
            group.set_status(SequenceStatus.RUNNING)
            self._insert_by_arrival(self.running, group)
            self._allocate_and_emit(group, self._plan_tokens(group, step.budget, prompt_budget=self._prompt_budget(group, step)), step)

    def _schedule_waiting(self, step: _Step) -> None:
        """Waiting groups, in queue order, while the budget, `max_num_seqs` and the free blocks
        (minus the watermark) allow. Each sequence first adopts its cached prefix."""
        bm = self.block_manager
        index = 0  # groups before it wait for their API request's share of the seats
        while index < len(self.waiting) and step.budget > 0:
            group = self.waiting[index]
            if over_share(group, self.running, self._seats, self.config.max_num_seqs):
                index += 1
                continue
            if self._num_seats_taken() + self._seats(group) > self.config.max_num_seqs:
                return
            prefixes = {seq.seq_id: self._cached_prefix(group, seq) for seq in group.unfinished_seqs()}
            cached = {seq_id: len(p) * bm.block_size for seq_id, p in prefixes.items()}
            plan = self._plan_tokens(group, step.budget, cached, self._prompt_budget(group, step))
            if plan is None:
                return
            needed = bm.blocks_needed_together(plan, prefixes)
            if not bm.can_allocate(needed, keep_watermark=True):
                if not self.running and not self._can_ever_fit(group):
                    del self.waiting[index]
                    self._fail(group, "it needs more KV cache blocks than the device has")
                    continue
                return
            del self.waiting[index]
            for seq, _ in plan:
                seq.num_computed_tokens = bm.adopt_cached_prefix(seq, prefixes[seq.seq_id])
            if group.num_cached_tokens is None:  # first admission
                group.num_cached_tokens = group.seqs[0].num_computed_tokens
            group.set_status(SequenceStatus.RUNNING)
            self._insert_by_arrival(self.running, group)
            self._allocate_and_emit(group, plan, step)

    def _plan_tokens(
        self,
        group: SequenceGroup,
        budget: int,
        computed: dict[int, int] | None = None,
        prompt_budget: int | None = None,
        speculate: bool = False,
    ) -> list[tuple[Sequence, int]] | None:
        """How many tokens each unfinished sequence computes this step, or None if the group
        cannot progress within `budget`. `computed` overrides sequences' computed-token counts
        (for a waiting group, the prefix-cache hits it is about to take).

        A single sequence takes what the budget allows (chunked prefill). Several sequences must
        sample together, so each holds back its last token until all of them can compute it in
        the same step. A prompt's chunk also stays within `prompt_budget` (the step-time budget).
        With `speculate`, a decoding sequence also takes its proposed tokens
        (`Sequence.draft_token_ids`) as far as the budget allows; a group of several sequences
        takes all of them or none.
        """
        seqs = group.unfinished_seqs()
        computed = computed or {}
        remaining = [seq.num_tokens - computed.get(seq.seq_id, seq.num_computed_tokens) for seq in seqs]
        if prompt_budget is not None and len(seqs) == 1 and remaining[0] > 1:
            budget = min(budget, prompt_budget)
        if speculate and _has_drafts(group):
            drafted = [left + len(seq.draft_token_ids) if left == 1 else left for seq, left in zip(seqs, remaining)]
            if len(seqs) == 1 or sum(drafted) <= budget:
                remaining = drafted
        if len(seqs) == 1:
            n = min(remaining[0], budget)
            return [(seqs[0], n)] if n > 0 else None
        if sum(remaining) <= budget:
            return list(zip(seqs, remaining))
        plan = []
        for seq, left in zip(seqs, remaining):
            n = min(left - 1, budget)
            if n > 0:
                plan.append((seq, n))
                budget -= n
        return plan or None

    @staticmethod
    def _prompt_budget(group: SequenceGroup, step: _Step) -> int | None:
        """The step-time budget's prompt tokens left for this group's chunk: fewer for a prompt
        whose log-probabilities are computed (at least one while any is left)."""
        left = step.prompt_budget
        if left is None or step.logprob_price == 1.0 or not left:
            return left
        if not any(_wants_prompt_logprobs(group, seq) for seq in group.unfinished_seqs()):
            return left
        return max(1, int(left / step.logprob_price))

    def _cached_prefix(self, group: SequenceGroup, seq: Sequence):
        if _wants_prompt_logprobs(group, seq) or _needs_every_position(group):
            return []  # prompt log-probabilities (and mean or first-token pools) need every prompt position computed
        return self.block_manager.find_cached_prefix(seq)

    def _allocate_and_emit(self, group: SequenceGroup, plan: list[tuple[Sequence, int]], step: _Step) -> None:
        """Take the blocks the plan needs and add its sequences to the step's control message."""
        params = group.sampling_params
        penalties = params.needs_penalties
        pooling = group.pooling_params
        for seq, n in plan:
            if step.prompt_budget is not None and seq.num_uncomputed_tokens > 1:
                price = step.logprob_price if _wants_prompt_logprobs(group, seq) else 1.0
                step.prompt_budget = max(0, step.prompt_budget - math.ceil(n * price))
            self.block_manager.allocate(seq, n)
            start = seq.num_computed_tokens
            end = min(start + n, seq.num_tokens)  # the tokens past the sequence's own are proposals
            seq.draft_token_ids = drafts = seq.draft_token_ids[: start + n - end]
            if end < seq.num_tokens or pooling is not None:
                num_samples = 0
            elif params.best_of > 1 and params.sampling_type is not SamplingType.BEAM and not group.forked:
                num_samples = params.best_of
            else:
                num_samples = 1
            tables = self.block_manager.block_tables(seq.seq_id)
            targets = None
            if _wants_prompt_logprobs(group, seq):
                targets = seq.token_ids[start + 1 : min(end + 1, seq.num_prompt_tokens)]
            step.scheduled.append(
                ScheduledSequence(
                    seq_id=seq.seq_id,
                    request_id=group.request_id,
                    token_ids=seq.token_ids[start:end] + drafts,
                    start_position=start,
                    block_table=tables[0],
                    other_block_tables=tables[1:],
                    sampling_params=params,
                    num_samples=num_samples,
                    sample_index=seq.sample_index,
                    num_output_tokens=seq.num_output_tokens,
                    prompt_token_ids=seq.prompt_token_ids if penalties else None,
                    output_token_ids=seq.output_token_ids if penalties else None,
                    prompt_logprob_targets=targets,
                    draft_token_ids=drafts,
                    pooling_type=pooling.pooling_type if pooling is not None else None,
                )
            )
            step.budget -= n

    # --- preemption -------------------------------------------------------------------------

    def _preempt(self, group: SequenceGroup) -> None:
        """Evict all of the group's blocks: to CPU memory (swap) or dropped (recompute)."""
        self.stats.num_preemptions += 1
        seqs = group.unfinished_seqs()
        if choose_preemption_mode(self.config, self.block_manager, group) is PreemptionMode.SWAP and self.block_manager.can_swap_out(seqs):
            self.stats.num_blocks_swapped_out += self.block_manager.swap_out(seqs)
            self.stats.num_swap_preemptions += 1
            group.set_status(SequenceStatus.SWAPPED)
            self._insert_by_arrival(self.swapped, group)
            return
        self.stats.num_recompute_preemptions += 1
        for seq in seqs:
            self.block_manager.free(seq, keep_hashes=True)
            seq.num_computed_tokens = 0
        group.set_status(SequenceStatus.WAITING)
        # Preempted groups were admitted before every waiting one: they go first again.
        group.turn = PREEMPTED_TURN
        self.waiting.appendleft(group)

    @staticmethod
    def _insert_by_arrival(queue: list[SequenceGroup], group: SequenceGroup) -> None:
        keys = [g.arrival_time for g in queue]
        queue.insert(bisect.bisect_right(keys, group.arrival_time), group)

    def _can_ever_fit(self, group: SequenceGroup) -> bool:
        """Whether the group, alone on the device, could compute the tokens it has (a windowed
        group needs only its window's blocks at once, however long the sequence)."""
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        needed = sum(bm.max_blocks_of_sequence(seq.num_tokens, budget) for seq in group.unfinished_seqs())
        return needed <= bm.num_total_blocks - bm.watermark_blocks

    def _fail(self, group: SequenceGroup, reason: str) -> None:
        group.error = f"Request {group.request_id} cannot be scheduled: {reason}."
        for seq in group.unfinished_seqs():
            seq.status = SequenceStatus.FINISHED_ERROR
        self._free_group(group)
        self._failed.append(group)

    def update_draft_token_ids(self, drafts: dict[int, list[int]]) -> None:
        """Speculative decoding: the tokens proposed to follow each running sequence, for the
        next `schedule()` to verify as far as its budget allows; a sequence not named has none."""
        for group in self.running:
            for seq in group.unfinished_seqs():
                seq.draft_token_ids = drafts.get(seq.seq_id, [])

    # --- after a step -----------------------------------------------------------------------

    def update_from_output(
        self,
        output: SchedulerOutput,
        result: ModelRunnerOutput,
        seqs_by_id: dict[int, Sequence],
        process: ProcessOutput,
    ) -> StepUpdate:
        """Everything a computed step changes, in order: count the computed tokens (and keep
        the accepted proposals), let `process` append the sampled tokens and check stops, apply
        the forks and drops it decided, free what finished."""
        self._on_step_computed(output, seqs_by_id, result)
        update, bm = StepUpdate(), self.block_manager
        try:
            process(output, result, update)
        finally:  # drops decided before a failure too: a dropped beam is in no group to abort
            for seq in update.dropped:
                bm.free(seq)
        for parent, child in update.forks:
            if not bm.can_fork(parent, share=self.share_blocks):
                raise RuntimeError(
                    "Out of KV blocks while copying a sequence with enable_block_sharing=False; "
                    "that measuring mode needs a larger KV cache."
                )
            bm.fork(parent, child, share=self.share_blocks)
        update.finished = self._free_finished()
        return update

    def _on_step_computed(self, output: SchedulerOutput, seqs_by_id: dict[int, Sequence], result: ModelRunnerOutput) -> None:
        """The model has written the scheduled tokens into the cache: advance the sequences and
        publish their newly full blocks to the prefix cache, before new tokens are appended.
        A speculating sequence keeps the proposed tokens the model accepted (`result`) and rolls
        back the slots of the rejected ones."""
        for item in output.seqs:
            seq = seqs_by_id[item.seq_id]
            num_drafts = len(item.draft_token_ids)
            if num_drafts:
                step = result.outputs.get(item.seq_id)
                num_accepted = len(step.accepted) if step is not None else 0
                seq.num_computed_tokens += len(item.token_ids) - num_drafts + num_accepted
                self.block_manager.rollback(seq, num_drafts - num_accepted)
                seq.draft_token_ids = []
            else:
                seq.num_computed_tokens += len(item.token_ids)
            self.block_manager.commit(seq)

    def _free_finished(self) -> list[SequenceGroup]:
        """Free the blocks of every finished sequence and take finished groups off the running
        queue. Finished sequences of a still-running group free their blocks at once. Then
        sample the step's KV memory breakdown. Returns the groups that finished."""
        still_running, finished = [], []
        for group in self.running:
            for seq in group.seqs:
                if seq.is_finished and self.block_manager.has_blocks(seq.seq_id):
                    self.block_manager.free(seq)
            if group.is_finished:
                self._finished_request_ids.append(group.request_id)
                finished.append(group)
            else:
                still_running.append(group)
        self.running = still_running
        live = (seq for group in still_running for seq in group.seqs if not seq.is_finished)
        self.kv_breakdown.add(self.block_manager.slot_breakdown(live))
        return finished

    def _free_group(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            self.block_manager.free(seq)  # device and CPU blocks alike
        self._finished_request_ids.append(group.request_id)
