"""Executors run the workers: in this process, or as tensor-parallel processes."""

from pagedllm.executor.base import Executor, create_executor

__all__ = ["Executor", "create_executor"]
