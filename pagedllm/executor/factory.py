"""Choosing an executor: its own module, so that the executors and the engine all import
`base` and none of them imports another executor."""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.executor.base import Executor


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
