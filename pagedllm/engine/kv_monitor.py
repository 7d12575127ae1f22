"""What the live dashboard reads: KV snapshots and counters over time, published by the engine.

`KVMonitor` is a stat logger of the async engine, so it runs on the engine's thread after every
loop iteration, between two steps: the only moment the block manager may be read. It keeps

- the latest `KVSnapshot` (`core.kv_snapshot`), rebuilt only while a reader has asked for one
  in the last `WATCH_TIMEOUT_S` (a dashboard open), at most every `SNAPSHOT_INTERVAL_S`, and
  less often where a snapshot is expensive (a large pool): building it and encoding it for the
  readers take at most `COST_BUDGET` of the step time. Once the engine holds no request, the next
  snapshot comes `SNAPSHOT_INTERVAL_S` after the last whatever its cost (no step pays for it), so
  a page never shows finished requests' blocks held. With nobody watching, the engine pays a
  clock read per iteration;
- one point of counters every `SERIES_INTERVAL_S` over the last `SERIES_LENGTH` points (requests
  running, waiting and swapped, KV usage, preemptions by kind, prefix-cache hit rate, tokens per
  second, time to first token and per output token), kept whether or not anybody watches;
- what the snapshots cost: their build time against the step time that passed while watched.

Readers on other threads take `latest`, `version` and `series()`: the snapshot is replaced
whole, never changed after it is published.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from pagedllm.core.kv_snapshot import KVSnapshot, build_kv_snapshot
from pagedllm.engine.iteration_stats import IterationStats
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.stats import EngineStats


@dataclass(slots=True)
class SnapshotCost:
    num_snapshots: int = 0
    snapshot_seconds: float = 0.0  # building snapshots, on the engine's thread
    reader_seconds: float = 0.0  # turning them into JSON, on the server's threads
    step_seconds_watched: float = 0.0  # engine steps that ran while somebody watched

    @property
    def share_of_step_time(self) -> float | None:
        if not self.step_seconds_watched:
            return None
        return self.snapshot_seconds / self.step_seconds_watched


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _step_seconds(stats: EngineStats) -> float:
    step = stats.step_time
    return step.scheduler + step.model + step.outputs


class KVMonitor:
    """A `StatLogger` publishing KV snapshots and a time series of counters (see the module)."""

    SNAPSHOT_INTERVAL_S = 0.5
    COST_BUDGET = 0.01  # share of the time that building and encoding snapshots may take
    WATCH_TIMEOUT_S = 5.0
    SERIES_INTERVAL_S = 0.5
    SERIES_LENGTH = 600  # five minutes of points

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.latest: KVSnapshot | None = None
        self.version = 0  # bumped with each published snapshot
        self.latest_stats: EngineStats | None = None
        self.cost = SnapshotCost()
        self._wanted_until = 0.0
        self._next_snapshot_at = 0.0
        self._published_at = float("-inf")
        self._last_reader_seconds = 0.0
        self._state_key: tuple | None = None
        self._series: deque[dict] = deque(maxlen=self.SERIES_LENGTH)
        self._series_lock = threading.Lock()
        self._ttfts: list[float] = []
        self._itls: list[float] = []
        self._last_point: tuple[float, EngineStats] | None = None
        self._last_step_seconds: float | None = None  # the engine's step time at the last record

    # --- readers (any thread) ---------------------------------------------------------------

    def want(self) -> None:
        """Ask for snapshots for the next `WATCH_TIMEOUT_S` seconds."""
        self._wanted_until = time.monotonic() + self.WATCH_TIMEOUT_S

    @property
    def watched(self) -> bool:
        return time.monotonic() < self._wanted_until

    def note_reader_cost(self, seconds: float) -> None:
        """A reader spent `seconds` encoding the latest snapshot (it spaces the next ones)."""
        self.cost.reader_seconds += seconds
        self._last_reader_seconds = seconds

    def series(self, after: float | None = None) -> list[dict]:
        """The counter points, oldest first; with `after`, only those taken later (wall time)."""
        with self._series_lock:
            points = list(self._series)
        return points if after is None else [p for p in points if p["time"] > after]

    # --- the engine's thread ----------------------------------------------------------------

    def record(self, stats: EngineStats, iteration: IterationStats) -> None:
        now = time.monotonic()
        self.latest_stats = stats
        self._ttfts.extend(iteration.time_to_first_tokens)
        self._itls.extend(iteration.inter_token_latencies)
        step_seconds = _step_seconds(stats)
        watched = now < self._wanted_until
        if watched and self._last_step_seconds is not None:
            self.cost.step_seconds_watched += step_seconds - self._last_step_seconds
        self._last_step_seconds = step_seconds
        if self._last_point is None or now - self._last_point[0] >= self.SERIES_INTERVAL_S:
            self._add_point(now, stats)
        # An idle engine's snapshot costs no step time: the spacing by cost does not hold it back.
        idle_due = len(self._engine.requests) == 0 and now - self._published_at >= self.SNAPSHOT_INTERVAL_S
        if watched and (now >= self._next_snapshot_at or idle_due):
            self._publish(now)

    def _publish(self, now: float) -> None:
        engine = self._engine
        bm = engine.block_manager
        # Unchanged since the last snapshot (an idle engine): nothing to rebuild.
        key = (engine.num_steps, len(engine.requests), bm.num_free_blocks, getattr(bm, "num_free_cpu_blocks", 0))
        if key != self._state_key or self.latest is None:
            start = time.perf_counter()
            sched = engine.scheduler
            groups = [*sched.running, *sched.swapped, *sched.waiting]
            cow_seen = self.latest.num_copy_on_writes if self.latest is not None else 0
            snapshot = build_kv_snapshot(bm, groups, cow_seen)
            seconds = time.perf_counter() - start
            self.cost.snapshot_seconds += seconds
            self.cost.num_snapshots += 1
            self._state_key = key
            self._published_at = now
            self.latest = snapshot
            self.version += 1
            spacing = (seconds + self._last_reader_seconds) / self.COST_BUDGET
            self._next_snapshot_at = now + max(self.SNAPSHOT_INTERVAL_S, spacing)
        else:  # never sooner than an expensive snapshot's spacing asked (an idle check lands here)
            self._next_snapshot_at = max(self._next_snapshot_at, now + self.SNAPSHOT_INTERVAL_S)

    def _add_point(self, now: float, stats: EngineStats) -> None:
        tokens_per_s = None
        if self._last_point is not None:
            then, before = self._last_point
            tokens_per_s = (stats.num_generation_tokens - before.num_generation_tokens) / (now - then)
        point = {
            "time": time.time(),
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "swapped": stats.num_swapped,
            "kv_usage": stats.kv_cache_usage,
            "swap_preemptions": stats.num_swap_preemptions,
            "recompute_preemptions": stats.num_recompute_preemptions,
            "prefix_hit_rate": stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else None,
            "tokens_per_s": tokens_per_s,
            "ttft_s": _mean(self._ttfts),
            "tpot_s": _mean(self._itls),
        }
        self._ttfts, self._itls = [], []
        self._last_point = (now, stats)
        with self._series_lock:
            self._series.append(point)
