"""Bad requests get OpenAI-shaped errors naming the field, run nothing, and leave requests in flight undisturbed."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.server.common import GREEDY, MODEL, metric_samples, raw_json, stats, wait_until


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
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"not-a-token": 1.0}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1.0}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2000}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    # Non-finite numbers.
    ("/v1/completions", {"prompt": "hi", "temperature": float("nan")}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": float("inf")}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True, "n": 2, "length_penalty": float("nan")}, 400, "length_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": float("-inf")}, 400, "top_p"),
    # Invalid Unicode (a lone surrogate) in any text field.
    ("/v1/completions", {"prompt": "hi \ud800"}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "\udfff"]}, 400, "prompt"),
    ("/v1/completions", {"model": "\ud800", "prompt": "hi"}, 400, "model"),
    ("/v1/completions", {"prompt": "hi", "stop": ["\ud800"]}, 400, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, 400, "messages"),
    ("/tokenize", {"prompt": "\ud800"}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages"),
    # A value of another JSON type than the OpenAPI document gives (found by the schema fuzzing).
    ("/v1/completions", {"prompt": "hi", "temperature": False}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "add_special_tokens": "true"}, 400, "add_special_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/detokenize", {"tokens": [True, False]}, 400, "tokens"),
]


@pytest.mark.parametrize(("route", "body", "status", "param"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors_naming_the_field(server_url, route, body, status, param):
    response = httpx.post(server_url + route, **raw_json(body))
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
    unknown = httpx.post(server_url + "/infill", json={"prompt": "hi"})  # llama-server's route, not served here
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "invalid_request_error"
    assert unknown.json()["error"]["message"] == (
        "This server has no route POST /infill; its routes are listed at /openapi.json."
    )
    assert "GET /v1/nothing" in httpx.get(server_url + "/v1/nothing").json()["error"]["message"]
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
                    replies = await asyncio.gather(*(http.post(route, **raw_json(body)) for route, body, _, _ in BAD_REQUESTS))
                    assert all(r.status_code in (400, 404) for r in replies)
                text += chunk.choices[0].text
            return text

    assert asyncio.run(run()) == expected


def test_an_empty_prompt_says_what_to_send_once(server_url):
    response = httpx.post(server_url + "/v1/completions", json={"prompt": ""})
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and message.count("prompt:") == 1
    assert "non-empty string, a non-empty list of token ids" in message
