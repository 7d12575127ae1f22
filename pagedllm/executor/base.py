"""The engine's only view of the workers: set up the KV cache, run a step, shut down."""

from __future__ import annotations

from abc import ABC, abstractmethod

from pagedllm.config import EngineConfig
from pagedllm.core.model_output import ModelRunnerOutput
from pagedllm.core.scheduler_output import SchedulerOutput


class WorkerDiedError(RuntimeError):
    """A worker process is gone; the engine cannot run another step."""


class Executor(ABC):
    block_bytes: int  # bytes of one KV block on one worker, all layers, keys and values

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


def create_executor(config: EngineConfig, max_model_len: int) -> Executor:
    """One worker in this process, or a tensor-parallel group with this process as its driver.

    Under torchrun (`distributed_init_method="env://"`), every rank runs the same program: rank 0
    goes on to be the engine, the other ranks serve as workers here until the driver shuts
    down, then exit."""
    if config.parallel.tensor_parallel_size > 1:
        from pagedllm.distributed.init import env_rank
        from pagedllm.executor.multiproc import MultiprocExecutor, run_worker_loop

        if config.parallel.distributed_init_method == "env://" and env_rank() > 0:
            run_worker_loop(config, max_model_len, env_rank(), "env://")
            raise SystemExit(0)
        return MultiprocExecutor(config, max_model_len)
    from pagedllm.executor.uniproc import UniprocExecutor

    return UniprocExecutor(config, max_model_len)
