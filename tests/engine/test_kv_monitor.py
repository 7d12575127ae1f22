"""The dashboard's publisher (`engine.kv_monitor`): it builds no snapshot while nobody watches,
spaces expensive ones to stay within its share of the time, and keeps counter points."""

from __future__ import annotations

import dataclasses
import time
import types

import pytest

from pagedllm.engine import kv_monitor
from pagedllm.engine.iteration_stats import IterationStats
from pagedllm.engine.kv_monitor import KVMonitor
from pagedllm.engine.stats import EngineStats, StepTime
from pagedllm.sampling_params import SamplingParams
from tests.engine.fakes import FakeEngine, tokens


def _stats(**values) -> EngineStats:
    required = [f.name for f in dataclasses.fields(EngineStats) if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING]
    return EngineStats(**{**dict.fromkeys(required, 0), **values})


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = _Clock()
    fake_time = types.SimpleNamespace(monotonic=clock.monotonic, perf_counter=time.perf_counter, time=time.time)
    monkeypatch.setattr(kv_monitor, "time", fake_time)
    return clock


class _Engine:
    """What the monitor reads of an `LLMEngine`, over the model-free fake engine."""

    def __init__(self) -> None:
        self.fake = FakeEngine(block_size=4, num_blocks=32)
        self.block_manager = self.fake.bm
        self.scheduler = self.fake.scheduler
        self.requests = self.fake.requests
        self.num_steps = 0
        self.fake.add("r1", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))

    def step(self) -> None:
        self.fake.step(lambda item: tokens(1))
        self.num_steps += 1


def _record(monitor: KVMonitor, **stats) -> None:
    monitor.record(_stats(**stats), IterationStats(now=0.0))


def test_nothing_is_built_while_nobody_watches(clock):
    engine = _Engine()
    monitor = KVMonitor(engine)
    for _ in range(5):
        engine.step()
        clock.now += 1.0
        _record(monitor)
    assert monitor.latest is None and monitor.cost.num_snapshots == 0
    assert len(monitor.series()) == 5  # counters are kept all the same


def test_a_reader_gets_the_current_tables_at_most_every_half_second(clock):
    engine = _Engine()
    monitor = KVMonitor(engine)
    engine.step()
    monitor.want()
    _record(monitor)
    assert monitor.version == 1
    assert monitor.latest.requests[0].seqs[0].block_ids == engine.block_manager.block_ids(engine.fake.requests.groups["r1"].seqs[0].seq_id)
    engine.step()
    clock.now += 0.1
    _record(monitor)
    assert monitor.version == 1  # too soon
    clock.now += 0.5
    _record(monitor)
    assert monitor.version == 2
    clock.now += monitor.WATCH_TIMEOUT_S + 1  # the reader left
    engine.step()
    _record(monitor)
    assert monitor.version == 2


def test_expensive_snapshots_are_spaced_to_stay_within_the_budget(clock):
    engine = _Engine()
    monitor = KVMonitor(engine)
    monitor.want()
    _record(monitor)
    monitor.note_reader_cost(1.0)  # a reader spent a second encoding it (a huge pool)
    engine.step()
    clock.now += 0.6
    _record(monitor)
    assert monitor.version == 2
    spacing = 1.0 / monitor.COST_BUDGET  # the next snapshot waits until this cost is that share
    for wait in (spacing / 2, spacing / 2 + 1):
        engine.step()
        clock.now += wait
        monitor.want()
        _record(monitor)
    assert monitor.version == 3 and monitor.cost.num_snapshots == 3


def test_once_the_requests_finish_the_page_sees_it_within_half_a_second_whatever_the_cost(clock):
    engine = _Engine()
    monitor = KVMonitor(engine)
    monitor.want()
    _record(monitor)
    monitor.note_reader_cost(1.0)  # one slow encoding (a busy machine): snapshots spaced 100 s apart
    engine.step()
    clock.now += 0.6
    _record(monitor)
    assert monitor.version == 2
    engine.step()
    while engine.requests:  # r1 runs to its end; the spacing holds snapshots back meanwhile
        clock.now += 0.6
        monitor.want()
        _record(monitor)
        engine.step()
    assert monitor.version == 2 and monitor.latest.requests
    clock.now += 0.6
    _record(monitor)  # the engine's first iteration with no request
    assert monitor.version == 3 and monitor.latest.requests == []
    assert engine.block_manager.num_free_blocks == 32
    clock.now += 0.6
    _record(monitor)  # idle and unchanged: nothing new to publish
    # A new request: while it runs, the expensive snapshots' spacing holds again.
    engine.fake.add("r2", [1, 2, 3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.step()
    clock.now += 0.6
    monitor.want()
    _record(monitor)
    assert monitor.version == 3


def test_points_give_rates_and_mean_latencies_per_interval(clock):
    monitor = KVMonitor(_Engine())
    _record(monitor, num_generation_tokens=100, prefix_cache_queries=40, prefix_cache_hits=10)
    clock.now += 2.0
    iteration = IterationStats(now=0.0, time_to_first_tokens=[0.2, 0.4], inter_token_latencies=[0.01, 0.03])
    monitor.record(_stats(num_generation_tokens=160, num_running=3, kv_cache_usage=0.5), iteration)
    first, second = monitor.series()
    assert first["tokens_per_s"] is None and first["prefix_hit_rate"] == 0.25
    assert second["tokens_per_s"] == pytest.approx(30.0)
    assert second["ttft_s"] == pytest.approx(0.3) and second["tpot_s"] == pytest.approx(0.02)
    assert (second["running"], second["kv_usage"], second["prefix_hit_rate"]) == (3, 0.5, None)
    assert monitor.series(after=first["time"]) == [second]


def test_the_cost_counts_only_step_time_that_passed_while_watched(clock):
    monitor = KVMonitor(_Engine())
    monitor.want()
    _record(monitor, step_time=StepTime(model=100.0))  # the engine's time before anybody watched
    clock.now += 1.0
    _record(monitor, step_time=StepTime(model=102.0))
    clock.now += monitor.WATCH_TIMEOUT_S  # the reader left
    _record(monitor, step_time=StepTime(model=110.0))
    assert monitor.cost.step_seconds_watched == pytest.approx(2.0)
    assert monitor.cost.share_of_step_time == pytest.approx(monitor.cost.snapshot_seconds / 2.0)
