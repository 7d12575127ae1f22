"""The OpenAI-compatible server, started for real on a free loopback port (in a thread, once for
the module) and driven with the official `openai` client and httpx."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm import __version__
from pagedllm.entrypoints.cli import build_parser, main
from pagedllm.entrypoints.openai.api_server import create_server
from tests.helpers import random_prompts

MODEL = "tiny"
MAX_MODEL_LEN = 256
SERVE_FLAGS = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "64MiB", "--swap-space", "0.01",
               "--served-model-name", MODEL, "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server_url(tiny_llama):
    args = build_parser().parse_args(["serve", str(tiny_llama), "--port", "0", *SERVE_FLAGS])
    server = create_server(args)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def async_client(server_url):
    return lambda: openai.AsyncOpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama))


def stats(server_url: str) -> dict:
    return httpx.get(server_url + "/stats").json()


def metric_samples(server_url: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels without model_name) -> value, parsed by prometheus_client."""
    text = httpx.get(server_url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def streamed_completion(client, **kwargs) -> tuple[dict[int, str], dict[int, str], dict | None]:
    """Texts and finish reasons by choice index, and the usage, of a streamed completion."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    return texts, reasons, usage


# --- endpoints ---------------------------------------------------------------------------------


def test_models_health_and_version(client, server_url):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.model_dump()["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(server_url + "/health").status_code == 200
    assert httpx.get(server_url + "/version").json() == {"version": __version__}


def test_completion_streamed_text_equals_non_streamed_and_usage_is_right(client, tokenizer):
    prompt = "The capital of France is"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY)
    texts, reasons, usage = streamed_completion(client, model=MODEL, prompt=prompt, max_tokens=24, **GREEDY)
    assert texts == {0: full.choices[0].text} and full.choices[0].text
    assert reasons == {0: "length"} == {0: full.choices[0].finish_reason}
    num_prompt = len(tokenizer.encode(prompt))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (num_prompt, 24, num_prompt + 24)
    assert usage["prompt_tokens"] == num_prompt and usage["completion_tokens"] == 24
    # The same prompt again is served from the prefix cache (its full blocks, at least).
    client.completions.create(model=MODEL, prompt=[7] * 40, max_tokens=2, **GREEDY)
    again = client.completions.create(model=MODEL, prompt=[7] * 40, max_tokens=2, **GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens == 32


def test_chat_streamed_equals_non_streamed_and_counts_template_tokens(client, server_url, tokenizer):
    messages = [{"role": "user", "content": "Tell me a joke about cats."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, **GREEDY)
    deltas, roles, usage = [], [], None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, stream=True, stream_options={"include_usage": True}, **GREEDY
    ):
        for choice in chunk.choices:
            roles += [choice.delta.role] if choice.delta.role else []
            deltas.append(choice.delta.content or "")
        usage = chunk.usage or usage
    assert "".join(deltas) == full.choices[0].message.content and full.choices[0].message.role == "assistant"
    assert roles == ["assistant"]
    template = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    num_prompt = len(tokenizer.encode(template, add_special_tokens=False))
    assert full.usage.prompt_tokens == usage.prompt_tokens == num_prompt
    assert full.usage.completion_tokens == usage.completion_tokens == 20
    counted = httpx.post(server_url + "/tokenize", json={"messages": messages}).json()
    assert counted["count"] == num_prompt and counted["max_model_len"] == MAX_MODEL_LEN


def test_stop_string_cuts_streamed_and_non_streamed_text_alike(client):
    prompt = [11, 22, 33, 44, 55]
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, **GREEDY).choices[0].text
    stop = text[10:13]  # usually spans a token boundary, so a prefix of it arrives first
    expected = text[: text.find(stop)]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, stop=[stop], **GREEDY).choices[0]
    texts, reasons, _ = streamed_completion(client, model=MODEL, prompt=prompt, max_tokens=30, stop=[stop], **GREEDY)
    assert (cut.text, cut.finish_reason, cut.model_dump()["stop_reason"]) == (expected, "stop", stop)
    assert texts == {0: expected} and reasons == {0: "stop"}


def test_n_returns_n_choices_streamed_or_not(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, n=3, temperature=1.0, seed=1,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    assert sorted(c.index for c in full.choices) == [0, 1, 2]
    assert len({c.text for c in full.choices}) > 1  # sampled, not three copies
    texts, reasons, usage = streamed_completion(client, **kwargs)
    assert texts == {c.index: c.text for c in full.choices}  # the request's own seed: same samples
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert full.usage.completion_tokens == usage["completion_tokens"] == 3 * 8


def test_batch_of_prompts_numbers_choices_prompt_by_prompt(client, tokenizer):
    prompts = ["Hello there", "The weather today"]
    full = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, n=2, temperature=1.0, seed=3,
                                     extra_body={"ignore_eos": True})
    assert sorted(c.index for c in full.choices) == [0, 1, 2, 3]
    assert full.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert full.usage.completion_tokens == 4 * 5


def test_echo_prepends_the_prompt_streamed_or_not(client):
    kwargs = dict(model=MODEL, prompt="Echo this:", max_tokens=4, echo=True, **GREEDY)
    full = client.completions.create(**kwargs).choices[0].text
    plain = client.completions.create(**{**kwargs, "echo": False}).choices[0].text
    texts, _, _ = streamed_completion(client, **kwargs)
    assert full == "Echo this:" + plain and texts == {0: full}


def test_beam_search_returns_the_best_beams_streamed_or_not(client):
    kwargs = dict(model=MODEL, prompt="The best way to learn is", max_tokens=8, n=2,
                  extra_body={"use_beam_search": True, "best_of": 3, "ignore_eos": True})
    full = client.completions.create(**kwargs)
    texts, _, _ = streamed_completion(client, **kwargs)
    assert len(full.choices) == 2 and texts == {c.index: c.text for c in full.choices}


def test_logprobs_in_openai_shapes(client):
    completion = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, logprobs=2, **GREEDY).choices[0]
    lp = completion.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) >= 2 and top[token] == logprob
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY
    ).choices[0]
    content = chat.logprobs.content
    assert len(content) == 5
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert len(entry.top_logprobs) == 3
        # Greedy decoding picks the most likely token.
        assert (entry.token, entry.logprob) == (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())


def test_tokenize_and_detokenize_round_trip(server_url, tokenizer):
    tokens = httpx.post(server_url + "/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()["tokens"]
    assert tokens == tokenizer.encode("Hello world")
    assert httpx.post(server_url + "/detokenize", json={"tokens": tokens}).json() == {"prompt": "Hello world"}


# --- load and disconnects ----------------------------------------------------------------------


def test_many_concurrent_streaming_clients_all_complete_with_their_own_text(client, async_client):
    prompts = random_prompts(40, [2, 5, 11, 23], seed=9)

    async def stream(api, prompt):
        text, usage = "", None
        response = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY)
        async for chunk in response:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def run_all():
        async with async_client() as api:
            return await asyncio.gather(*(stream(api, p) for p in prompts))

    results = asyncio.run(run_all())
    assert [n for _, n in results] == [12] * len(prompts)
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, **GREEDY).choices[0].text for p in prompts]
    assert [text for text, _ in results] == alone  # batching with others changes no greedy output


def test_disconnected_clients_abort_their_requests_and_free_all_blocks(client, server_url):
    aborted_before = metric_samples(server_url).get(("pagedllm:request_success_total", (("finished_reason", "abort"),)), 0)
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        streams = [http.stream("POST", server_url + "/v1/completions", json=body) for _ in range(8)]
        for ctx in streams:
            response = ctx.__enter__()
            next(line for line in response.iter_lines() if line.startswith("data: "))  # generating
        for ctx in streams:
            ctx.__exit__(None, None, None)
    # A non-streamed request whose client gives up waiting is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server_url + "/v1/completions", timeout=0.3,
                   json={**body, "stream": False, "n": 4, "temperature": 1.0})

    def all_free() -> bool:
        s = stats(server_url)
        return s["num_running"] == s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]

    wait_until(all_free)
    aborted = metric_samples(server_url)[("pagedllm:request_success_total", (("finished_reason", "abort"),))]
    assert aborted - aborted_before == 9
    assert client.completions.create(model=MODEL, prompt="still there?", max_tokens=3).choices[0].finish_reason


# --- errors ------------------------------------------------------------------------------------

BAD_REQUESTS = [
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"prompt": [9] * 300}, 400, "prompt"),
    ("/v1/completions", {"prompt": [9] * 100, "max_tokens": 200}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2000}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors_naming_the_field(server_url, route, body, status, param):
    response = httpx.post(server_url + route, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_a_batch_with_one_bad_prompt_runs_none_of_them(server_url):
    abort = ("pagedllm:request_success_total", (("finished_reason", "abort"),))
    before = metric_samples(server_url).get(abort, 0)
    response = httpx.post(server_url + "/v1/completions",
                          json={"prompt": [[5, 6, 7], [9] * 300], "max_tokens": 200, "ignore_eos": True})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    wait_until(lambda: metric_samples(server_url).get(abort, 0) == before + 1)  # the good one, aborted
    assert stats(server_url)["num_running"] == 0


def test_malformed_json_and_unknown_routes_get_openai_errors(server_url, client):
    response = httpx.post(server_url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    assert httpx.get(server_url + "/v1/nothing").json()["error"]["message"] == "Not Found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-2)


def test_bad_requests_do_not_disturb_requests_in_flight(client, async_client, server_url):
    prompt = [3, 1, 4, 1, 5]
    expected = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, **GREEDY).choices[0].text

    async def run():
        async with async_client() as api, httpx.AsyncClient(base_url=server_url) as http:
            text = ""
            response = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=60, stream=True, **GREEDY)
            async for chunk in response:
                if not text:  # in flight: now throw every bad request at the server
                    replies = await asyncio.gather(*(http.post(route, json=body) for route, body, _, _ in BAD_REQUESTS))
                    assert all(r.status_code in (400, 404) for r in replies)
                text += chunk.choices[0].text
            return text

    assert asyncio.run(run()) == expected


# --- metrics and benchmark ---------------------------------------------------------------------


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


def test_bench_serve_reports_latencies_and_writes_json(server_url, tmp_path, capsys):
    from pagedllm.bench.datasets import sample_requests
    from pagedllm.bench.serve import MAX_PROMPT_TOKEN_ID

    out = tmp_path / "serve.json"
    code = main(["bench", "serve", "--base-url", server_url, "--num-prompts", "6", "--request-rate", "50",
                 "--output-json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "ttft_ms" in printed and "normalized_latency_s_per_token" in printed
    result = json.loads(out.read_text())["results"]
    planned = sample_requests("sharegpt", 6, MAX_MODEL_LEN, MAX_PROMPT_TOKEN_ID, token_range=(100, MAX_PROMPT_TOKEN_ID - 1))
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["output_tokens"] == sum(r.output_len for r in planned)  # ignore_eos: every planned token
    assert 0 < result["ttft_ms"]["median"] <= result["e2e_latency_ms"]["p99"]
    assert result["normalized_latency_s_per_token"] > 0


# --- the command line and a dead engine ----------------------------------------------------------


def test_pagedllm_serve_command_requires_the_api_key(tiny_llama):
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(tiny_llama), "--port", "0",
               "--api-key", "s3cret", *SERVE_FLAGS[:-2], "--uvicorn-log-level", "info"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in process.stderr:
            match = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
            if match:
                port = int(match.group(1))
                break
        assert port, "the server did not start"
        url = f"http://127.0.0.1:{port}"
        threading.Thread(target=process.stderr.read, daemon=True).start()  # keep the pipe drained
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        response = httpx.post(url + "/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/health").status_code == 200  # only /v1 is guarded, as in vLLM
        api = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert api.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    finally:
        process.terminate()
        process.wait(30)


def test_a_dead_engine_makes_health_503_and_requests_fail_cleanly(tiny_llama):
    from fastapi.testclient import TestClient

    from pagedllm import EngineArgs
    from pagedllm.engine.async_llm_engine import AsyncLLMEngine
    from pagedllm.entrypoints.openai.api_server import build_app

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), max_model_len=MAX_MODEL_LEN, num_gpu_blocks=32))
    engine.IDLE_POLL_S = 0.05

    def gone():
        raise RuntimeError("worker 1 exited")

    engine.engine.executor.check_health = gone
    with TestClient(build_app(engine, [MODEL], log_stats=False)) as http:
        wait_until(lambda: http.get("/health").status_code == 503, timeout=30)
        assert "worker 1 exited" in http.get("/health").json()["error"]["message"]
        response = http.post("/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
