"""Executors run the workers: in this process, or as tensor-parallel processes."""

from pagedllm.executor.base import Executor, WorkerDiedError
from pagedllm.executor.factory import create_executor

__all__ = ["Executor", "WorkerDiedError", "create_executor"]
