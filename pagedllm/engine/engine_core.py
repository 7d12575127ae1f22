"""The engine core: the owner of the step.

One `step()`: schedule -> execute -> `scheduler.update_from_output`, which counts the computed
tokens, runs output processing (sampled tokens appended, stops checked), and applies the forks,
drops and frees it decided. Around it, the parts that some engines have: grammars whose bitmasks
fill each step, a speculator whose proposals enter through the scheduler, the step-time budget
passed to `schedule()`. The front ends (`LLMEngine`, and `AsyncLLMEngine` over it) tokenize,
detokenize and stream; the paper's simulator and the test harnesses drive this same class with
an executor of their own (a simulated clock, a fake model). `start_executor` sets up the real one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pagedllm.core import Scheduler, SequenceGroup, SequenceStatus
from pagedllm.core.model_output import ModelRunnerOutput
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.core.step_update import ProcessOutput, StepUpdate
from pagedllm.engine.requests import RequestRegistry
from pagedllm.engine.step_timer import StepTimer
from pagedllm.executor.base import WorkerDiedError

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.constraints import RequestConstraints
    from pagedllm.engine.spec_decode import Speculator
    from pagedllm.engine.step_budget import StepBudget
    from pagedllm.executor import Executor

logger = logging.getLogger("pagedllm")


class StepExecutor(Protocol):
    """What the core needs of an executor: run one step (the real `Executor`, or a stand-in)."""

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput | None: ...


@dataclass
class EngineStep:
    """What one `EngineCore.step` did."""

    scheduled: SchedulerOutput | None = None  # None: nothing ran
    touched: list[SequenceGroup] = field(default_factory=list)  # progressed or ended, schedule order
    failed: list[SequenceGroup] = field(default_factory=list)  # ended with an error (`group.error`)
    time: float = 0.0  # time.monotonic() once the model's results were in
    outputs: Any = None  # what the caller's `make_outputs` made of the step


class EngineCore:
    """The scheduler (the only writer of the KV cache manager), an executor and output
    processing, driven one step at a time; the live requests in `requests`."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: StepExecutor,
        process: ProcessOutput,
        requests: RequestRegistry | None = None,
        *,
        constraints: "RequestConstraints | None" = None,
        speculator: "Speculator | None" = None,
        step_budget: "StepBudget | None" = None,
        check_invariants: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.requests = requests if requests is not None else RequestRegistry()
        self.constraints = constraints
        self.speculator = speculator
        self.step_budget = step_budget
        self.check_invariants = check_invariants
        self.timer = StepTimer()
        self._process = process
        self.num_steps = 0
        self.num_computed_tokens = 0
        self.last_scheduled: SchedulerOutput | None = None  # the latest step's message (None: nothing ran)
        self.dead: str | None = None  # why the core can no longer run (a worker died)

    @property
    def block_manager(self):
        return self.scheduler.block_manager

    # --- requests ---------------------------------------------------------------------------

    def add(self, group: SequenceGroup) -> None:
        """A new request (`make_sequence_group`); one with a grammar still compiling is
        scheduled once the grammar is ready."""
        self.requests.add_group(group)
        if not (self.constraints is not None and group.sampling_params.needs_token_mask and self.constraints.hold(group)):
            self.scheduler.add(group)

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Stop a request wherever it is and free its blocks; None if it is unknown."""
        group = self.scheduler.abort(request_id)
        if group is None and self.constraints is not None:
            group = self.constraints.drop(request_id)
        if group is not None:
            self.requests.remove_group(group)
        return group

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.constraints is not None and self.constraints.pending)

    # --- the step ---------------------------------------------------------------------------

    def step(self, make_outputs: Callable[[EngineStep], Any] | None = None) -> EngineStep:
        """Run one iteration. Finished and failed groups leave `requests` before it returns.
        `make_outputs(step)` (a front end's outputs: texts, metrics) runs inside the step, so
        its time counts in the step-time budget and the `outputs` part; its result is the
        step's `outputs`."""
        begin = time.perf_counter()
        step = self._step()
        self.last_scheduled = step.scheduled
        if make_outputs is not None:
            with self.timer.part("outputs"):
                step.outputs = make_outputs(step)
        if step.scheduled is not None:
            self._observe_step(step.scheduled, time.perf_counter() - begin)
        return step

    def _step(self) -> EngineStep:
        timer = self.timer
        with timer.part("scheduler"):
            failed = self._release_compiled()
            limit = self.step_budget.chunk_limit if self.step_budget is not None else None
            if self.speculator is not None:
                self.scheduler.update_draft_token_ids(self.speculator.propose(self.scheduler, limit))
            price = self.step_budget.logprob_price if self.step_budget is not None else 1.0
            scheduled = self.scheduler.schedule(limit, price)
            for group in self.scheduler.take_failed():
                logger.warning("%s", group.error)
                self.requests.remove_group(group)
                failed.append(group)
        if not scheduled.has_model_work and not scheduled.has_cache_work and not scheduled.finished_request_ids:
            return EngineStep(failed=failed)
        if self.constraints is not None:
            with timer.part("grammar"):
                self.constraints.fill_bitmasks(scheduled, self.requests.seqs)
        try:
            with timer.part("model"):
                started = time.perf_counter()
                if self.speculator is not None:
                    self.speculator.fill(scheduled, self.requests.seqs)
                result = self.executor.execute(scheduled) or ModelRunnerOutput()
                model_seconds = time.perf_counter() - started
        except WorkerDiedError as exc:
            return EngineStep(failed=failed + self.fail_everything(str(exc)))
        except BaseException:
            self.scheduler.requeue_finished(scheduled.finished_request_ids)
            raise
        self.num_steps += 1
        now = time.monotonic()
        with timer.part("scheduler"):
            if self.speculator is not None and scheduled.has_model_work:
                self.speculator.observe(scheduled, result, model_seconds)
            self.num_computed_tokens += scheduled.num_batched_tokens
            update = self.scheduler.update_from_output(scheduled, result, self.requests.seqs, self._timed_process)
            if self.check_invariants:
                self.block_manager.check_invariants()
            for group in update.finished:
                self.requests.remove_group(group)
        return EngineStep(scheduled, update.touched, failed, now)

    def _timed_process(self, scheduled: SchedulerOutput, result: ModelRunnerOutput, update: StepUpdate) -> None:
        with self.timer.part("outputs"):
            self._process(scheduled, result, update)

    def _observe_step(self, scheduled: SchedulerOutput, seconds: float) -> None:
        """A step that ran the model teaches the step-time budget its cost per prompt token.
        With adaptive speculation, steps that verified proposed tokens are left out: it stops
        while the budget holds prompts back (`Speculator.propose`), so the steps that admit
        prompts verify nothing, and their cost is that of the steps that did not."""
        if self.step_budget is None:
            return
        adaptive = self.speculator is not None and self.speculator.config.adaptive
        if adaptive and any(item.draft_token_ids for item in scheduled.seqs):
            return
        prompt_tokens = sum(len(item.token_ids) for item in scheduled.seqs if len(item.token_ids) > 1)
        logprob_tokens = sum(len(item.prompt_logprob_targets or ()) for item in scheduled.seqs)
        self.step_budget.observe(seconds, prompt_tokens, logprob_tokens)

    def _release_compiled(self) -> list[SequenceGroup]:
        """Schedule the requests whose grammar is compiled now; fail those whose grammar failed.
        With nothing else to run, wait a moment for a grammar rather than spin."""
        if self.constraints is None:
            return []
        ready, failed = self.constraints.take_ready(wait=not self.scheduler.has_unfinished())
        for group in ready:
            self.scheduler.add(group)
        for group, error in failed:
            self._end_with_error(group, error)
        return [group for group, _ in failed]

    def _end_with_error(self, group: SequenceGroup, error: str) -> None:
        group.error = error
        for seq in group.seqs:
            seq.status = SequenceStatus.FINISHED_ERROR
        self.requests.remove_group(group)

    def fail_everything(self, reason: str) -> list[SequenceGroup]:
        """A worker died: every request in flight ends with an error; the core stops."""
        logger.error("Engine stopped: %s", reason)
        self.dead = reason
        failed = list(self.requests.groups.values())
        for group in failed:
            self.scheduler.abort(group.request_id)
            if self.constraints is not None:
                self.constraints.drop(group.request_id)
            self._end_with_error(group, f"The engine stopped: {reason}")
        return failed

    def shutdown(self) -> None:
        if self.constraints is not None:
            self.constraints.shutdown()
        if self.speculator is not None:
            self.speculator.shutdown()
        shutdown = getattr(self.executor, "shutdown", None)
        if shutdown is not None:
            shutdown()


# --- the real executor ------------------------------------------------------------------------


def start_executor(config: "EngineConfig", max_model_len: int) -> tuple["Executor", Scheduler]:
    """The workers (model and KV cache, sized from their memory budgets) and the scheduler with
    its KV cache manager for them. For the `auto` preemption mode it measures what swapping a
    block and recomputing a token cost on the real pools and model."""
    from pagedllm.core import create_scheduler
    from pagedllm.executor import create_executor
    from pagedllm.kv_spec import max_blocks_of_sequence

    executor = create_executor(config, max_model_len)
    # One block table per group of layers; a sliding-window group frees what left its window.
    group_windows = executor.group_windows
    num_device_blocks, num_cpu_blocks = executor.determine_num_blocks()
    block_size = config.cache.block_size
    needed = max_blocks_of_sequence(group_windows, max_model_len, block_size, config.scheduler.max_num_batched_tokens)
    if num_device_blocks < needed:
        raise ValueError(
            f"The KV cache holds {num_device_blocks} blocks ({num_device_blocks * block_size} token slots), "
            f"fewer than one sequence of max_model_len={max_model_len} needs ({needed} blocks). "
            f"Raise kv_cache_memory to at least {needed * executor.block_bytes} bytes "
            f"(or num_gpu_blocks to {needed}), or lower max_model_len."
        )
    executor.init_cache(num_device_blocks, num_cpu_blocks)
    # The blocks, their bytes and where memory went are in the start-up summary
    # (`startup_summary`, logged once the engine is ready).
    # The KV memory policy (kv_policy) picks the block manager: blocks on demand, or one of the
    # paper's contiguous-reservation baselines.
    sched_config = config.scheduler
    if sched_config.preemption_mode == "auto" and num_cpu_blocks and sched_config.kv_policy == "paged":
        swap_cost, recompute_cost = executor.profile_preemption_costs()  # logged, measured or read (profile_cache)
        sched_config = dataclasses.replace(sched_config, swap_cost_per_block=swap_cost, recompute_cost_per_token=recompute_cost)
    scheduler = create_scheduler(
        sched_config,
        block_size,
        num_device_blocks,
        num_cpu_blocks,
        max_model_len,
        enable_prefix_caching=config.cache.enable_prefix_caching,
        group_windows=group_windows,
        share_blocks=config.cache.enable_block_sharing,
    )
    return executor, scheduler
