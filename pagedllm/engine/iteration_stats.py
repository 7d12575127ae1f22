"""Per-iteration latency samples for metrics: time to first token, inter-token latency and
finished requests, derived from the `RequestOutput`s of each engine step.

Plain data and a small tracker; stat loggers (Prometheus, the periodic log line) read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.engine.stats import EngineStats
from pagedllm.outputs import PoolingRequestOutput, RequestOutput


@dataclass(slots=True)
class FinishedRequest:
    finish_reason: str  # "stop", "length", "abort" or "error"
    e2e_latency: float | None  # seconds from arrival to the last output; None for aborts
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What happened to requests in one loop iteration of the async engine."""

    now: float
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)


class StatLogger(Protocol):
    """Receives the engine's counters and each iteration's samples (on the engine's thread)."""

    def record(self, stats: EngineStats, iteration: IterationStats) -> None: ...


class RequestTimingTracker:
    """Remembers, per running request, when it last produced tokens, so each step's outputs turn
    into latency samples: a request's first tokens give a time to first token, later ones an
    inter-token latency (the gap between the two steps that produced them)."""

    def __init__(self) -> None:
        # request id -> (time of its latest tokens, tokens generated so far)
        self._last: dict[str, tuple[float, int]] = {}

    def observe(self, outputs: list[RequestOutput | PoolingRequestOutput], stats: IterationStats) -> None:
        """Add the samples of one step's outputs to `stats` (a pooling request generates no
        tokens: it counts only once finished)."""
        now = stats.now
        for out in outputs:
            generated = isinstance(out, RequestOutput)
            num_tokens = sum(len(c.token_ids) for c in out.outputs) if generated else 0
            metrics = out.metrics
            token_time = (metrics.last_token_time if metrics else None) or now
            previous = self._last.get(out.request_id)
            if previous is None and num_tokens:
                if metrics is not None and metrics.first_token_time is not None:
                    stats.time_to_first_tokens.append(metrics.first_token_time - metrics.arrival_time)
                self._last[out.request_id] = (token_time, num_tokens)
            elif previous is not None and num_tokens != previous[1]:
                # A step that only recomputed a preempted request's tokens produces none: skip it.
                stats.inter_token_latencies.append(token_time - previous[0])
                self._last[out.request_id] = (token_time, num_tokens)
            if out.finished:
                self._last.pop(out.request_id, None)
                finish_reason = out.outputs[0].finish_reason if generated and out.outputs else None
                reason = "error" if out.error else finish_reason or "stop"
                end = (metrics.finished_time if metrics else None) or now
                stats.finished.append(
                    FinishedRequest(
                        finish_reason=reason,
                        e2e_latency=end - metrics.arrival_time if metrics else None,
                        num_prompt_tokens=len(out.prompt_token_ids),
                        num_generation_tokens=num_tokens,
                    )
                )

    def abort(self, request_id: str, stats: IterationStats) -> None:
        """A request was aborted: stop tracking it and count it as finished by abort."""
        self._last.pop(request_id, None)
        stats.finished.append(FinishedRequest("abort", None, 0, 0))

    @property
    def num_tracked(self) -> int:
        return len(self._last)
