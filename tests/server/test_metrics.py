"""The /metrics page parses as Prometheus text and its counters move exactly with the requests served."""

from __future__ import annotations

from tests.server.common import GREEDY, MODEL, metric_samples, wait_until


def test_metrics_parse_and_move_with_requests(client, server_url):
    before = metric_samples(server_url)
    out = client.completions.create(model=MODEL, prompt=[8, 9, 10, 11], max_tokens=7, **GREEDY)
    success = ("pagedllm:request_success_total", (("finished_reason", "length"),))
    wait_until(lambda: metric_samples(server_url).get(success, 0) > before.get(success, 0))
    after = metric_samples(server_url)

    def moved(name: str) -> float:
        return after[(name, ())] - before.get((name, ()), 0)

    assert out.usage.completion_tokens == 7
    assert moved("pagedllm:generation_tokens_total") == 7
    assert moved("pagedllm:prompt_tokens_total") == 4
    assert after[success] - before.get(success, 0) == 1
    assert moved("pagedllm:time_to_first_token_seconds_count") == 1
    assert moved("pagedllm:inter_token_latency_seconds_count") == 6
    assert moved("pagedllm:e2e_request_latency_seconds_count") == 1
    assert moved("pagedllm:prefix_cache_queries_total") >= 4
    for gauge in ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc"):
        assert (f"pagedllm:{gauge}", ()) in after
    assert ("pagedllm:num_preemptions_total", ()) in after and ("pagedllm:prefix_cache_hits_total", ()) in after
    # The KV memory breakdown (the paper's Figure 2), averaged over the steps: four parts adding up to 1.
    breakdown = {dict(labels)["part"]: value for (name, labels), value in after.items() if name == "pagedllm:kv_cache_breakdown_perc"}
    assert set(breakdown) == {"token_states", "reservation", "internal_fragmentation", "external_fragmentation_free"}
    assert abs(sum(breakdown.values()) - 1.0) < 1e-6 and breakdown["token_states"] > 0 and breakdown["reservation"] == 0
