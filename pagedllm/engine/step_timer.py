"""Where a step's time goes: the scheduler (core), the model (executor), output processing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from pagedllm.engine.stats import StepTime


class StepTimer:
    """Accumulates wall time per part of `LLMEngine.step` into a `StepTime`."""

    def __init__(self) -> None:
        self.total = StepTime()

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Time the enclosed code as `name` (a field of `StepTime`)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self.total, name, getattr(self.total, name) + time.perf_counter() - start)

    def snapshot(self) -> StepTime:
        return StepTime(**vars(self.total))
