"""Where a step's time goes: the scheduler (core), the model (executor), output processing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from pagedllm.engine.stats import StepTime


class StepTimer:
    """Accumulates wall time per part of `EngineCore.step` into a `StepTime`."""

    def __init__(self) -> None:
        self.total = StepTime()
        self._nested = 0.0  # seconds of parts timed inside the part now running

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Time the enclosed code as `name` (a field of `StepTime`); a part timed inside it
        (output processing inside the scheduler's update) counts as its own, not twice."""
        start, outer = time.perf_counter(), self._nested
        self._nested = 0.0
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            setattr(self.total, name, getattr(self.total, name) + elapsed - self._nested)
            self._nested = outer + elapsed

    def snapshot(self) -> StepTime:
        return StepTime(**vars(self.total))
