"""Where a step's time goes: the scheduler (core), the model (executor), output processing."""

from __future__ import annotations

import time

from pagedllm.engine.stats import StepTime


class StepTimer:
    """Accumulates wall time per part of `EngineCore.step` into a `StepTime`."""

    def __init__(self) -> None:
        self.total = StepTime()
        self._nested = 0.0  # seconds of parts timed inside the part now running

    def part(self, name: str) -> "_Part":
        """Time the enclosed code (`with timer.part(name):`) as `name`, a field of `StepTime`; a
        part timed inside it (output processing inside the scheduler's update) counts as its
        own, not twice."""
        return _Part(self, name)

    def snapshot(self) -> StepTime:
        return StepTime(**vars(self.total))


class _Part:
    """One timed part (a plain class: a step times several, and a generator-based context
    manager costs several times more)."""

    __slots__ = ("timer", "name", "start", "outer")

    def __init__(self, timer: StepTimer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        timer = self.timer
        self.outer, timer._nested = timer._nested, 0.0
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        elapsed = time.perf_counter() - self.start
        timer, total = self.timer, self.timer.total
        setattr(total, self.name, getattr(total, self.name) + elapsed - timer._nested)
        timer._nested = self.outer + elapsed
