"""The step timer's accounting (on a fake clock): a part timed inside another counts as its own
and is left out of the outer one, so the parts of a step add up to its time."""

from __future__ import annotations

import types

from pagedllm.engine import step_timer
from pagedllm.engine.step_timer import StepTimer


def test_a_nested_part_is_charged_once(monkeypatch):
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(step_timer, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    timer = StepTimer()
    with timer.part("scheduler"):
        clock.now += 1.0
        with timer.part("outputs"):
            clock.now += 3.0
        clock.now += 2.0
    with timer.part("scheduler"):
        clock.now += 0.5
    with timer.part("model"):
        clock.now += 10.0
    total = timer.snapshot()
    assert (total.scheduler, total.outputs, total.model) == (3.5, 3.0, 10.0)
    assert total.scheduler + total.outputs + total.model == clock.now
