"""The engine's only view of the workers: set up the KV cache, run a step, shut down."""

from __future__ import annotations

from abc import ABC, abstractmethod

from pagedllm.config import EngineConfig
from pagedllm.core.model_output import ModelRunnerOutput
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.kv_spec import KVCacheGroup


class WorkerDiedError(RuntimeError):
    """A worker process is gone; the engine cannot run another step."""


class Executor(ABC):
    block_bytes: int  # bytes of one KV block on one worker, all its tensors, keys and values
    # The model's layers grouped by sliding window, one block table each (`kv_spec`): plain data
    # the engine's KV cache manager is built from.
    kv_cache_groups: list[KVCacheGroup]

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        """The sliding window of each KV cache group (None: full attention)."""
        return tuple(group.sliding_window for group in self.kv_cache_groups)

    @abstractmethod
    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) that fit every worker's budgets."""

    @abstractmethod
    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None: ...

    @abstractmethod
    def profile_preemption_costs(self) -> tuple[float, float]:
        """(seconds to swap a block out and in, seconds to recompute a token), on the driver."""

    @abstractmethod
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; the driver's sampled tokens come back."""

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    def shutdown(self) -> None: ...
