"""The engine core: the scheduler and KV cache manager beside the executor, one step at a time.

At start-up it sizes the KV cache from the workers' memory budgets, and for the `auto`
preemption mode measures what swapping a block and recomputing a token cost on the real pools
and model. Each step it schedules, runs the control message on every worker, and advances the
sequences whose tokens were computed. Requests, outputs and stop checks are `LLMEngine`'s.
"""

from __future__ import annotations

import dataclasses
import logging

from pagedllm.config import EngineConfig, SchedulerConfig
from pagedllm.core import BlockManager, Scheduler, Sequence, create_scheduler
from pagedllm.core.model_output import ModelRunnerOutput
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.executor import Executor, create_executor
from pagedllm.kv_spec import max_blocks_of_sequence

logger = logging.getLogger("pagedllm")


class EngineCore:
    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.executor: Executor = create_executor(config, max_model_len)
        # One block table per group of layers; a sliding-window group frees what left its window.
        self.group_windows = tuple(group.sliding_window for group in self.executor.kv_cache_groups)
        num_device_blocks, num_cpu_blocks = self.executor.determine_num_blocks()
        self._check_cache_fits(num_device_blocks)
        self.executor.init_cache(num_device_blocks, num_cpu_blocks)
        block_size = config.cache.block_size
        logger.info(
            "KV cache: %d device blocks of %d tokens (%d tokens, %.2f GiB); %d CPU swap blocks",
            num_device_blocks,
            block_size,
            num_device_blocks * block_size,
            num_device_blocks * self.executor.block_bytes / 2**30,
            num_cpu_blocks,
        )
        # The KV memory policy (kv_policy) picks the block manager: blocks on demand, or one
        # of the paper's contiguous-reservation baselines.
        self.scheduler: Scheduler = create_scheduler(
            self._scheduler_config(num_cpu_blocks),
            block_size,
            num_device_blocks,
            num_cpu_blocks,
            max_model_len,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            group_windows=self.group_windows,
        )
        self.block_manager: BlockManager = self.scheduler.block_manager
        worker = getattr(self.executor, "worker", None)  # the driver's worker, in this process
        if worker is not None:  # where memory goes, once the pools exist and were exercised
            logger.info("%s", worker.memory_budget())

    def _check_cache_fits(self, num_device_blocks: int) -> None:
        block_size = self.config.cache.block_size
        needed = max_blocks_of_sequence(
            self.group_windows, self.max_model_len, block_size, self.config.scheduler.max_num_batched_tokens
        )
        if num_device_blocks < needed:
            raise ValueError(
                f"The KV cache holds {num_device_blocks} blocks ({num_device_blocks * block_size} token slots), "
                f"fewer than one sequence of max_model_len={self.max_model_len} needs ({needed} blocks). "
                f"Raise kv_cache_memory to at least {needed * self.executor.block_bytes} bytes "
                f"(or num_gpu_blocks to {needed}), or lower max_model_len."
            )

    def _scheduler_config(self, num_cpu_blocks: int) -> SchedulerConfig:
        """The scheduler's configuration, with the `auto` preemption costs measured here."""
        config = self.config.scheduler
        if config.preemption_mode != "auto" or not num_cpu_blocks or config.kv_policy != "paged":
            return config
        swap_cost, recompute_cost = self.executor.profile_preemption_costs()
        logger.info(
            "Preemption costs: %.3g ms to swap a block out and in, %.3g ms to recompute a token",
            swap_cost * 1e3,
            recompute_cost * 1e3,
        )
        return dataclasses.replace(config, swap_cost_per_block=swap_cost, recompute_cost_per_token=recompute_cost)

    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def execute(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        """Run the control message on every worker (raises `WorkerDiedError` if one is gone)."""
        return self.executor.execute(scheduled) or ModelRunnerOutput()

    def advance(self, scheduled: SchedulerOutput, seqs: dict[int, Sequence], result: ModelRunnerOutput | None = None) -> None:
        """The scheduled tokens are in the KV cache now (before the sampled tokens are appended);
        of proposed tokens, those `result` accepted."""
        self.scheduler.on_step_computed(scheduled, seqs, result)

    def free_finished(self) -> None:
        """Free the blocks of sequences that finished in this step's output processing."""
        self.scheduler.free_finished()

    def shutdown(self) -> None:
        self.executor.shutdown()
