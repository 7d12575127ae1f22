"""A server started with `--speculative-config` exports vLLM's spec_decode counters in /metrics
(`pagedllm:` prefix), and they move with the tokens it verifies; the periodic log line reports them."""

from __future__ import annotations

import httpx

from pagedllm.cli import build_parser
from pagedllm.engine.stat_logger import LoggingStatLogger
from tests.server.common import SERVE_FLAGS, metric_samples, start_server_thread

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1, "adaptive": false}'


def test_spec_decode_counters_in_metrics(tiny_models):
    model = tiny_models("llama", vocab_size=64)  # a small vocabulary repeats itself: n-gram proposals
    args = build_parser().parse_args(["serve", str(model), "--port", "0", *SERVE_FLAGS, "--speculative-config", SPEC])
    server, thread, url = start_server_thread(args)
    try:
        before = metric_samples(url)
        body = {"model": "tiny", "prompt": [5, 9, 5, 9, 5, 9, 17, 5, 9], "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        after = metric_samples(url)
    finally:
        server.should_exit = True
        thread.join(30)

    def moved(name: str, labels=()) -> float:
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    drafts = moved("pagedllm:spec_decode_num_drafts_total")
    drafted = moved("pagedllm:spec_decode_num_draft_tokens_total")
    accepted = moved("pagedllm:spec_decode_num_accepted_tokens_total")
    per_pos = [moved("pagedllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(p)),)) for p in range(4)]
    assert 0 < drafts <= drafted and 0 < accepted <= drafted
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)


def test_the_log_line_reports_speculative_decoding():
    from pagedllm.engine.stats import EngineStats

    fields = {f: 0 for f in EngineStats.__dataclass_fields__ if f not in ("step_time", "kv_breakdown", "spec_decode_num_accepted_tokens_per_pos")}
    before = EngineStats(**fields)
    after = EngineStats(**{**fields, "spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 40, "spec_decode_num_accepted_tokens": 30})
    line = LoggingStatLogger.summary(before, after, 5.0)
    assert "SpecDecoding: Mean acceptance length: 4.00, Accepted: 30 tokens, Drafted: 40 tokens, Draft acceptance rate: 75.0%" in line
    assert "SpecDecoding" not in LoggingStatLogger.summary(before, before, 5.0)
