"""The scheduler of the reservation baselines (Orca, FasterTransformer-style static batching).

It is the FCFS scheduler of `core.scheduler` with admission by reservation
(`core.reservation`) in place of blocks on demand:
1. Running groups, oldest first, get the tokens they still need. Their reservations hold their
   final length, so nothing ever runs out and nothing is preempted.
2. Waiting groups are admitted oldest first while the token budget and `max_num_seqs` allow and
   every sequence's reservation fits. A group that does not fit waits, and so does everything
   behind it (first come, first served).

Static batching (`static`, FasterTransformer with a Triton-style batcher) admits only when
nothing runs: up to the batch size that memory allows for maximum-length reservations, whole
prompts at once, and the batch then runs until its longest output ends.
"""

from __future__ import annotations

import sys

from pagedllm.config import SchedulerConfig
from pagedllm.core.reservation import KVPolicy, ReservationBlockManager
from pagedllm.core.scheduler import Scheduler, _Step
from pagedllm.core.sequence import SequenceGroup, SequenceStatus


class ReservationScheduler(Scheduler):
    block_manager: ReservationBlockManager

    def __init__(self, config: SchedulerConfig, block_manager: ReservationBlockManager, share_blocks: bool = True) -> None:
        super().__init__(config, block_manager, share_blocks)
        self.static_batching = block_manager.policy is KVPolicy.STATIC
        # Static batching: the groups of the batch now running (kept until it is all done).
        self.current_batch: list[SequenceGroup] = []
        self.num_batches = 0

    def _schedule_running(self, step: _Step) -> None:
        for group in self.running:
            plan = self._plan_tokens(group, step.budget)
            if plan is not None:
                self._allocate_and_emit(group, plan, step)

    def _schedule_waiting(self, step: _Step) -> None:
        if self.static_batching:
            if self.running:
                return  # the batch runs until its longest output ends
            self.current_batch = []
        bm = self.block_manager
        while self.waiting and (step.budget > 0 or self.static_batching):
            group = self.waiting[0]
            if self._num_seats_taken() + self._seats(group) > self.config.max_num_seqs:
                break
            # A static batch computes its (padded) prompts whole, in one step.
            plan = self._plan_tokens(group, sys.maxsize if self.static_batching else step.budget)
            if plan is None:
                break
            if not bm.can_reserve(group):
                if not self.running and not bm.can_ever_reserve(group):
                    self.waiting.popleft()
                    self._fail(group, "its reservation is larger than the KV cache")
                    continue
                break
            self.waiting.popleft()
            bm.reserve(group)
            if group.num_cached_tokens is None:
                group.num_cached_tokens = 0
            group.set_status(SequenceStatus.RUNNING)
            self._insert_by_arrival(self.running, group)
            self._allocate_and_emit(group, plan, step)
            if self.static_batching:
                self.current_batch.append(group)
        if self.static_batching and self.current_batch:
            self.num_batches += 1
