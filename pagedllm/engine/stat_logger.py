"""The periodic one-line summary a serving engine logs, as vLLM does:

    Avg prompt throughput: 120.3 tokens/s, Avg generation throughput: 310.5 tokens/s,
    Running: 12 reqs, Swapped: 0 reqs, Waiting: 3 reqs, KV cache usage: 41.2%,
    Prefix cache hit rate: 12.5%
"""

from __future__ import annotations

import logging

from pagedllm.engine.iteration_stats import IterationStats
from pagedllm.engine.stats import EngineStats

logger = logging.getLogger("pagedllm")


class LoggingStatLogger:
    """Logs throughput and queue state every `interval_s` seconds while there is work; an idle
    engine logs once more after its last request and then stays quiet."""

    def __init__(self, interval_s: float = 5.0, log=logger.info) -> None:
        self.interval_s = interval_s
        self.log = log
        self._last_time: float | None = None
        self._last: EngineStats | None = None

    def record(self, stats: EngineStats, iteration: IterationStats) -> None:
        now = iteration.now
        if self._last_time is None or self._last is None:
            self._last_time, self._last = now, stats
            return
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return
        line = self.summary(self._last, stats, elapsed)
        busy = stats.num_running or stats.num_waiting or stats.num_swapped
        if busy or stats.num_prompt_tokens != self._last.num_prompt_tokens or stats.num_steps != self._last.num_steps:
            self.log(line)
        self._last_time, self._last = now, stats

    @staticmethod
    def summary(before: EngineStats, after: EngineStats, elapsed: float) -> str:
        prompt_rate = (after.num_prompt_tokens - before.num_prompt_tokens) / elapsed
        generation_rate = (after.num_generation_tokens - before.num_generation_tokens) / elapsed
        queries = after.prefix_cache_queries - before.prefix_cache_queries
        hits = after.prefix_cache_hits - before.prefix_cache_hits
        hit_rate = 100.0 * hits / queries if queries else 0.0
        return (
            f"Avg prompt throughput: {prompt_rate:.1f} tokens/s, "
            f"Avg generation throughput: {generation_rate:.1f} tokens/s, "
            f"Running: {after.num_running} reqs, Swapped: {after.num_swapped} reqs, "
            f"Waiting: {after.num_waiting} reqs, KV cache usage: {100.0 * after.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {hit_rate:.1f}%"
            + LoggingStatLogger._spec_decode(before, after)
        )

    @staticmethod
    def _spec_decode(before: EngineStats, after: EngineStats) -> str:
        """vLLM's speculative-decoding part of the line, over the interval (empty without it)."""
        drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
        if not drafts:
            return ""
        drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
        accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
        return (
            f", SpecDecoding: Mean acceptance length: {1 + accepted / drafts:.2f}, "
            f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
            f"Draft acceptance rate: {100.0 * accepted / drafted:.1f}%"
        )
