"""Oversized input is refused before any work: a body over --max-body-bytes gets 413 (declared or
chunked), a prompt too long for the context in any tokenization gets 400 untokenized, and
tokenizing happens off the event loop; a request that could outgrow the KV cache gets 400 with its numbers."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.server.common import MODEL

LIMIT = 1 << 20  # --max-body-bytes 1MiB in SERVE_FLAGS


def _chunks(data: bytes, size: int = 64 << 10):
    for start in range(0, len(data), size):
        yield data[start : start + size]


def test_a_body_over_the_limit_is_refused_with_413(server_url):
    body = b'{"prompt": "' + b"a" * (2 * LIMIT) + b'"}'
    response = httpx.post(server_url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 413
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "--max-body-bytes" in error["message"]


def test_a_chunked_body_over_the_limit_is_refused_with_413(server_url):
    body = b'{"prompt": "' + b"a" * (2 * LIMIT) + b'"}'
    response = httpx.post(server_url + "/tokenize", content=_chunks(body), headers={"content-type": "application/json"})
    assert response.status_code == 413


def test_a_chunked_body_within_the_limit_is_served(server_url):
    body = b'{"model": "%s", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}' % MODEL.encode()
    response = httpx.post(server_url + "/v1/completions", content=_chunks(body, 8), headers={"content-type": "application/json"})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", {"prompt": "word " * 100_000}, "prompt"),
        ("/v1/completions", {"prompt": ["hi", "word " * 100_000]}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 100_000}]}, "messages"),
        ("/tokenize", {"prompt": "word " * 100_000}, "prompt"),
    ],
)
def test_a_prompt_too_long_for_any_tokenization_is_refused_by_its_length(server_url, route, body, param):
    response = httpx.post(server_url + route, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and "characters" in error["message"]


def test_tokenizing_runs_on_its_own_thread(server_url):
    response = httpx.post(server_url + "/tokenize", json={"prompt": "The capital of France is"})
    assert response.status_code == 200 and response.json()["count"] > 0
    assert any(t.name.startswith("pagedllm-tokenizer") for t in threading.enumerate())


def test_a_request_that_can_never_fit_the_cache_is_a_400_with_the_numbers(tiny_llama):
    from fastapi.testclient import TestClient

    from pagedllm import EngineArgs
    from pagedllm.engine.async_llm_engine import AsyncLLMEngine
    from pagedllm.entrypoints.openai.api_server import build_app

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), max_model_len=128, num_gpu_blocks=12))
    with TestClient(build_app(engine, [MODEL], log_stats=False)) as http:
        # 8 samples of a 60-token prompt and 68 more tokens: 3 shared blocks + 8 x 5 = 43 of 16 tokens.
        body = {"prompt": [7] * 60, "n": 8, "max_tokens": 68, "temperature": 1.0}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "n"
        assert "need up to 43 blocks of 16 tokens, but the cache has 12" in error["message"]
        # The same prompt alone runs.
        response = http.post("/v1/completions", json={**body, "n": 1, "max_tokens": 4})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
