"""Prometheus metrics at `GET /metrics`, named like vLLM's with a `pagedllm:` prefix.

Each server has its own `CollectorRegistry` (tests run several servers in one process). The
async engine calls `record` on its own thread after every loop iteration, before it hands that
iteration's outputs to the clients (so a client that has its answer never reads its request as
running), and once more if its loop dies (its failed requests leave the gauges);
prometheus_client's metrics are thread-safe, and `/metrics` renders whatever was recorded last.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedllm.engine.iteration_stats import IterationStats
from pagedllm.engine.stats import EngineStats

# Bucket edges (seconds) as vLLM's, from a fast GPU to a busy CPU.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0]
_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]

# Engine counters (cumulative in EngineStats) exported as Prometheus counters.
_COUNTERS = {
    "prompt_tokens": ("num_prompt_tokens", "Prompt tokens of the requests received."),
    "generation_tokens": ("num_generation_tokens", "Tokens generated."),
    "num_preemptions": ("num_preemptions", "Requests preempted (swapped or recomputed)."),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "spec_decode_num_drafts": ("spec_decode_num_drafts", "Sequence-steps that verified proposed tokens (speculative decoding)."),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Proposed tokens verified."),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Proposed tokens accepted."),
}


class PrometheusStatLogger:
    """A `StatLogger` that keeps the server's Prometheus metrics."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagedllm:{name}", doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(f"pagedllm:{name}", doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.swapped = gauge("num_requests_swapped", "Requests swapped out to CPU memory.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.kv_breakdown = Gauge(
            "pagedllm:kv_cache_breakdown_perc",
            "Share of KV-cache slots in each part, averaged over the steps so far: token_states, reservation, "
            "internal_fragmentation, external_fragmentation_free (the paper's Figure 2; the parts add up to 1).",
            ["model_name", "part"],
            registry=self.registry,
        )
        self.counters = {
            field: Counter(f"pagedllm:{name}", doc, labels, registry=self.registry).labels(model_name)
            for name, (field, doc) in _COUNTERS.items()
        }
        self.accepted_per_pos = Counter(
            "pagedllm:spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens accepted, by position in the proposal (0: the first).",
            ["model_name", "position"],
            registry=self.registry,
        )
        self.request_success = Counter(
            "pagedllm:request_success", "Requests finished, by finish reason.", ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between successive tokens of a request.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.", _E2E_BUCKETS)
        self.prompt_lengths = histogram("request_prompt_tokens", "Prompt tokens per finished request.", _TOKEN_BUCKETS)
        self.output_lengths = histogram("request_generation_tokens", "Generated tokens per finished request.", _TOKEN_BUCKETS)
        self._last: EngineStats | None = None

    def record(self, stats: EngineStats, iteration: IterationStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.swapped.set(stats.num_swapped)
        self.kv_usage.set(stats.kv_cache_usage)
        for part, share in stats.kv_breakdown.items():
            self.kv_breakdown.labels(self.model_name, part).set(share)
        for field, counter in self.counters.items():
            # The engine's totals only grow; counters move by the difference since last time.
            delta = getattr(stats, field) - (getattr(self._last, field) if self._last else 0)
            if delta > 0:
                counter.inc(delta)
        before = self._last.spec_decode_num_accepted_tokens_per_pos if self._last else []
        for pos, total in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            delta = total - (before[pos] if pos < len(before) else 0)
            counter = self.accepted_per_pos.labels(self.model_name, str(pos))
            if delta > 0:
                counter.inc(delta)
        self._last = stats
        for value in iteration.time_to_first_tokens:
            self.ttft.observe(value)
        for value in iteration.inter_token_latencies:
            self.itl.observe(value)
        for finished in iteration.finished:
            self.request_success.labels(self.model_name, finished.finish_reason).inc()
            if finished.e2e_latency is not None:  # aborted requests have no latency to report
                self.e2e.observe(finished.e2e_latency)
                self.prompt_lengths.observe(finished.num_prompt_tokens)
                self.output_lengths.observe(finished.num_generation_tokens)
