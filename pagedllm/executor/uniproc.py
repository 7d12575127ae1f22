"""One worker, in the engine's own process."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.core.model_output import ModelRunnerOutput
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.executor.base import Executor
from pagedllm.worker.worker import Worker


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        self.worker = Worker(config, max_model_len)
        self.block_bytes = self.worker.block_bytes
        self.kv_cache_groups = self.worker.kv_cache_groups

    def determine_num_blocks(self) -> tuple[int, int]:
        return self.worker.determine_num_blocks()

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.init_cache(num_device_blocks, num_cpu_blocks)

    def profile_preemption_costs(self) -> tuple[float, float]:
        return self.worker.profile_preemption_costs()

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(output)
