"""Latency curves and the rate a system sustains, on the simulated clock, in parallel.

The paper reads throughput off normalized-latency-vs-rate curves: a system sustains a rate
while its latency stays near its unloaded value and loses it when the latency explodes. Here
the bar is explicit: a system sustains rate r if its normalized latency at r is at most a
threshold (twice vLLM's unloaded normalized latency, the same bar for every system, "at the
same latency"). `sustained_rate` brackets the highest such rate by stepping the rate up or
down by a factor, then halves the bracket (in log space) a few times; every rate it tries is a
point of the plotted curve.

Arrival times at rate r are one unit-rate Poisson trace divided by r, so a curve's points share
their request order and lengths and differ only in load.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field

from pagedllm.bench.paper.simulator import RunResult, Setup, simulate
from pagedllm.bench.progress import Progress
from pagedllm.bench.paper.traces import TraceRequest, make_trace


@dataclass(frozen=True)
class Curve:
    """One system on one workload: what a run at any rate needs."""

    system: str
    setup: Setup
    requests: tuple  # (prompt token ids, output length) pairs; a run takes the first ones
    trace_seconds: float | None = None  # a run at rate r takes r x this many requests; None: all
    min_requests: int = 1
    n: int = 1
    beam_width: int = 0
    seed: int = 0
    track_sharing: bool = False


@dataclass
class SearchResult:
    system: str
    sustained_rate: float  # 0.0: not even the lowest rate tried
    threshold: float
    points: list[RunResult] = field(default_factory=list)
    bounded: bool = True  # False: even the highest rate tried passed (the trace is too short to overload)
    bracket: tuple[float, float] | None = None  # the highest rate that passed, the lowest that failed

    def as_dict(self) -> dict:
        return {
            "system": self.system,
            "sustained_rate": self.sustained_rate,
            "threshold": self.threshold,
            "bounded": self.bounded,
            "bracket": self.bracket,
            "points": [p.as_dict() for p in sorted(self.points, key=lambda p: p.rate)],
        }


def num_requests_at(curve: Curve, rate: float) -> int:
    if curve.trace_seconds is None:
        return len(curve.requests)
    return max(min(curve.min_requests, len(curve.requests)), min(len(curve.requests), round(rate * curve.trace_seconds)))


def trace_at(curve: Curve, rate: float) -> list[TraceRequest]:
    """The requests a run of `curve` at `rate` serves, with their arrival times."""
    requests = list(curve.requests[: num_requests_at(curve, rate)])
    return make_trace(requests, rate, curve.seed, curve.n, curve.beam_width)


def run_at(curve: Curve, cost, rate: float) -> RunResult:
    """`curve` at `rate`, on the simulated clock priced by `cost`."""
    trace = trace_at(curve, rate)
    return simulate(curve.system, trace, curve.setup, cost, rate, track_sharing=curve.track_sharing, seed=curve.seed)


def sustained_rate(
    curve: Curve,
    cost,
    threshold: float,
    start: float,
    factor: float = 1.6,
    refinements: int = 2,
    max_moves: int = 10,
    run: Callable[[Curve, float], RunResult] | None = None,
    light_load_point: bool = True,
) -> SearchResult:
    """The highest rate whose normalized latency is at most `threshold`, searched from `start`:
    bracketed within factor ** (1 / 2 ** refinements), then interpolated between the bracket's
    ends (normalized latency linear in log rate). Each rate is run by `run(curve, rate)`: by
    default simulated (`run_at` priced by `cost`), on the real clock by `real_search`."""
    result = SearchResult(curve.system, 0.0, threshold)
    latency: dict[float, float] = {}
    run = run or (lambda c, rate: run_at(c, cost, rate))

    def ok(rate: float) -> bool:
        point = run(curve, rate)
        result.points.append(point)
        latency[rate] = point.normalized_latency if point.num_failed == 0 else math.inf
        return latency[rate] <= threshold

    mean_output = sum(out for _, out in curve.requests) / len(curve.requests)

    def whole_trace_at_once(rate: float) -> bool:
        """Past this rate the trace arrives faster than one request takes: a faster rate
        changes nothing (a trace too short to overload the system)."""
        return num_requests_at(curve, rate) / rate < threshold * mean_output

    low = high = None
    rate = start
    if ok(rate):
        low = rate
        for _ in range(max_moves):
            if whole_trace_at_once(rate):
                break
            rate *= factor
            if not ok(rate):
                high = rate
                break
            low = rate
    else:
        high = rate
        for _ in range(max_moves):
            rate /= factor
            if ok(rate):
                low = rate
                break
            high = rate
    if low is None or high is None:  # never passed, or never failed, within max_moves
        result.sustained_rate = low or 0.0
        result.bounded = high is not None
        return result
    for _ in range(refinements):
        mid = math.sqrt(low * high)
        if ok(mid):
            low = mid
        else:
            high = mid
    result.bracket = (low, high)
    result.sustained_rate = low
    if math.isfinite(latency[high]) and latency[high] > latency[low]:
        share = (threshold - latency[low]) / (latency[high] - latency[low])
        result.sustained_rate = low * (high / low) ** share
    if light_load_point and min(p.rate for p in result.points) > 0.5 * low:
        ok(0.3 * low)  # one light-load point, so the curve shows where it starts
    return result


def _search_task(args) -> SearchResult:
    return sustained_rate(*args)


def _run_task(args) -> RunResult:
    return run_at(*args)


class Pool:
    """Runs simulations on `jobs` processes (1: in this process)."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs

    def _map(self, fn, tasks: list) -> list:
        """fn(task) for each, in order; how many are done said on stderr every 10 s or so."""
        progress = Progress("bench paper")
        what = "rate searches done" if fn is _search_task else "simulations done"
        if self.jobs <= 1 or len(tasks) <= 1:
            results = []
            for task in tasks:
                results.append(fn(task))
                progress.update(len(results), len(tasks), what)
            return results
        with ProcessPoolExecutor(max_workers=min(self.jobs, len(tasks))) as pool:
            futures = [pool.submit(fn, task) for task in tasks]
            for done, _ in enumerate(as_completed(futures), 1):
                progress.update(done, len(tasks), what)
            return [future.result() for future in futures]

    def searches(self, tasks: list[tuple]) -> list[SearchResult]:
        """`sustained_rate(*task)` for each task."""
        return self._map(_search_task, tasks)

    def runs(self, tasks: list[tuple]) -> list[RunResult]:
        """`run_at(*task)` for each task."""
        return self._map(_run_task, tasks)
