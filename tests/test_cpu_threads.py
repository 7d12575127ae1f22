"""The CPU worker's thread count follows the cores other processes leave free."""

from __future__ import annotations

import time

import pytest

from pagedllm import LLM
from pagedllm.worker.cpu_threads import INTERVAL_S, QUIET_READINGS, ThreadGovernor, read_cpu_times, threads_for


def test_threads_for_gives_up_a_thread_per_busy_core():
    assert [threads_for(load, 2, 2) for load in (0.0, 0.2, 0.3, 1.0, 1.2, 1.3, 5.0)] == [2, 2, 1, 1, 1, 1, 1]
    assert [threads_for(load, 8, 16) for load in (0.0, 8.0, 9.0, 12.0)] == [8, 8, 7, 4]


class FakeMachine:
    """Cumulative CPU seconds: `others` cores busy besides this process, which uses `own` cores."""

    def __init__(self) -> None:
        self.now, self.busy, self.own, self.readings = 0.0, 0.0, 0.0, 0
        self.others, self.own_cores = 0.0, 2.0

    def run(self, seconds: float) -> None:
        self.now += seconds
        self.busy += (self.others + self.own_cores) * seconds
        self.own += self.own_cores * seconds

    def read(self) -> tuple[float, float]:
        self.readings += 1
        return self.busy, self.own


def governor(machine: FakeMachine, calls: list[int]) -> ThreadGovernor:
    return ThreadGovernor(max_threads=2, cores=2, reader=machine.read, clock=lambda: machine.now, set_threads=calls.append)


def test_a_busy_core_costs_a_thread_at_once_and_it_comes_back_after_quiet_readings():
    machine, calls = FakeMachine(), []
    gov = governor(machine, calls)
    for _ in range(3):
        machine.run(INTERVAL_S)
        assert gov.adjust() == 2
    machine.others = 1.0
    machine.run(INTERVAL_S)
    assert gov.adjust() == 1 and calls == [1]
    machine.others = 0.0
    for reading in range(QUIET_READINGS):
        machine.run(INTERVAL_S)
        assert gov.adjust() == (2 if reading == QUIET_READINGS - 1 else 1)
    assert calls == [1, 2]


def test_a_load_that_comes_and_goes_does_not_make_the_count_oscillate():
    machine, calls = FakeMachine(), []
    gov = governor(machine, calls)
    for second in range(12):
        machine.others = 1.0 if second % 2 == 0 else 0.0
        machine.run(INTERVAL_S)
        gov.adjust()
    assert calls == [1]


def test_readings_are_taken_once_per_interval_not_every_step():
    machine, calls = FakeMachine(), []
    gov = governor(machine, calls)
    for _ in range(40):
        machine.run(INTERVAL_S / 8)
        gov.adjust()
    assert machine.readings == 1 + 5  # the first at start-up, then one per interval


def test_cpu_times_are_read_from_proc():
    busy, own = read_cpu_times()
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    busy_after, own_after = read_cpu_times()
    assert 0 < own <= busy
    assert own_after - own >= 0.1 and busy_after - busy >= own_after - own - 0.02


@pytest.mark.parametrize("kwargs, on", [({}, True), ({"adapt_cpu_threads": False}, False), ({"batch_invariant": True}, False)])
def test_cpu_engines_adapt_their_threads_unless_told_not_to(tiny_llama, kwargs, on):
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32", max_model_len=64, num_gpu_blocks=16, **kwargs)
    assert (llm.llm_engine.executor.worker.thread_governor is not None) == on
