"""The /metrics page parses as Prometheus text, its counters move exactly with the requests served, and its
request gauges follow the requests: a finished, aborted or failed request is off them once its client knows."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.common import GREEDY, MAX_MODEL_LEN, MODEL, metric_samples, streamed_completion, wait_until


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


# --- the request gauges follow the requests (issue 51 item 9) -----------------------------------

_GAUGES = ("num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc")
_LONG = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 240, "ignore_eos": True, "temperature": 0}
_ABORTED = ("pagedllm:request_success_total", (("finished_reason", "abort"),))
_FAILED = ("pagedllm:request_success_total", (("finished_reason", "error"),))


def _gauges(samples: dict) -> dict[str, float]:
    return {name: samples[(f"pagedllm:{name}", ())] for name in _GAUGES}


def _idle(gauges: dict[str, float]) -> bool:
    return all(value == 0 for value in gauges.values())


def _wait_idle(read, timeout: float) -> dict[str, float]:
    """The gauges once they all read 0 (running, waiting, swapped, KV usage), polled for up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while not _idle(gauges := read()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return gauges


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_finished_request_is_off_the_gauges_before_its_client_hears_it_finished(client, server_url, stream):
    assert _idle(_wait_idle(lambda: _gauges(metric_samples(server_url)), 30))  # what earlier tests left
    kwargs = dict(model=MODEL, prompt=[8, 9, 10, 11], max_tokens=6, **GREEDY)
    if stream:
        _, reasons, _ = streamed_completion(client, **kwargs)
        assert reasons == {0: "length"}
    else:
        assert client.completions.create(**kwargs).choices[0].finish_reason == "length"
    # The first scrape after the answer, not a poll: the engine records a step before handing out its outputs.
    assert _gauges(metric_samples(server_url)) == dict.fromkeys(_GAUGES, 0)


def test_a_stream_in_flight_counts_as_running_and_leaves_the_gauges_when_its_client_disconnects(server_url):
    assert _idle(_wait_idle(lambda: _gauges(metric_samples(server_url)), 30))
    aborted_before = metric_samples(server_url).get(_ABORTED, 0)
    with httpx.stream("POST", server_url + "/v1/completions", json={**_LONG, "stream": True}, timeout=60) as response:
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        next(lines), next(lines)  # generating
        in_flight = _gauges(metric_samples(server_url))
    assert in_flight["num_requests_running"] == 1 and in_flight["num_requests_waiting"] == 0
    assert in_flight["num_requests_swapped"] == 0 and in_flight["kv_cache_usage_perc"] > 0
    # Disconnected: aborted, and off the gauges within a short poll (the abort waits for the step in progress).
    assert _wait_idle(lambda: _gauges(metric_samples(server_url)), 2.0) == dict.fromkeys(_GAUGES, 0)
    wait_until(lambda: metric_samples(server_url).get(_ABORTED, 0) == aborted_before + 1, timeout=2.0)


def _embedded_server(tiny_llama):
    """An engine of this test's own behind the server's app (a TestClient drives it)."""
    from fastapi.testclient import TestClient

    from pagedllm import EngineArgs
    from pagedllm.engine.async_llm_engine import AsyncLLMEngine
    from pagedllm.entrypoints.openai.api_server import build_app

    args = EngineArgs(model=str(tiny_llama), max_model_len=MAX_MODEL_LEN, num_gpu_blocks=32)
    engine = AsyncLLMEngine.from_engine_args(args)
    engine.IDLE_POLL_S = 0.05
    return engine, TestClient(build_app(engine, [MODEL], log_stats=False))


def _samples(http) -> dict:
    samples = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def test_the_gauges_never_lag_the_outputs_however_slow_the_engine_thread_is_to_record(tiny_llama):
    """Between handing out a step's outputs and recording its stats the engine's thread can lose the CPU
    (here: a snapshot that takes 0.3 s); a client that has its answer must still never read its request
    as running."""
    engine, server = _embedded_server(tiny_llama)
    get_stats = engine.engine.get_stats

    def slow_get_stats():
        time.sleep(0.3)
        return get_stats()

    engine.engine.get_stats = slow_get_stats
    body = {**_LONG, "max_tokens": 4}
    with server as http:
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
        assert _gauges(_samples(http)) == dict.fromkeys(_GAUGES, 0)
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as streamed:
            assert list(streamed.iter_lines())[-2:] == ["data: [DONE]", ""]
        assert _gauges(_samples(http)) == dict.fromkeys(_GAUGES, 0)


def test_requests_failed_by_a_dead_engine_leave_the_gauges(tiny_llama):
    """The engine's loop dies (a worker is gone) with a stream in flight: the request fails, and /metrics
    stops showing it running (it showed it for as long as the app lived)."""
    engine, server = _embedded_server(tiny_llama)
    with server as http:
        with http.stream("POST", "/v1/completions", json={**_LONG, "stream": True}) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            assert _gauges(_samples(http))["num_requests_running"] == 1

            def gone():
                raise RuntimeError("worker 1 exited")

            engine.engine.executor.check_health = gone
            assert any("worker 1 exited" in line for line in lines)  # the stream ends with the error
        wait_until(lambda: http.get("/health").status_code == 503, timeout=30)
        samples = _samples(http)
        assert _gauges(samples) == dict.fromkeys(_GAUGES, 0)
        assert samples.get(_FAILED) == 1
