"""Constraints as other servers' clients send them: vLLM's older `guided_json`, `guided_choice`,
`guided_regex` and `guided_grammar`, and llama.cpp's `grammar` (GBNF) and `json_schema`, on the
chat and completions endpoints, honoured over several seeds at temperature 1 (the tiny random
model would write anything unconstrained); two constraints at once, a bad one, and fields of
samplers this server does not implement are 400s naming them."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from tests.server.common import MODEL

SEEDS = range(4)
# JSON values with little room for whitespace (a random model wanders into runs of it in objects).
SCHEMA = {"enum": ["cat", "dog", {"pet": "fish"}]}
GBNF = 'root ::= ("yes" | "no") " " [0-9]'


def _completion(url: str, endpoint: str, seed: int, **fields) -> str:
    body = {"model": MODEL, "max_tokens": 40, "temperature": 1.0, "seed": seed, **fields}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "Answer."}]
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["message"]["content"]
    reply = httpx.post(url + "/v1/completions", json={"prompt": "Answer:", **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("fields, check", [
    ({"guided_choice": ["alpha", "beta gamma"]}, lambda text: text in ("alpha", "beta gamma")),
    ({"guided_regex": "[a-c]{3}-[0-9]{2}"}, lambda text: re.fullmatch("[a-c]{3}-[0-9]{2}", text)),
    ({"guided_grammar": GBNF}, lambda text: re.fullmatch("(yes|no) [0-9]", text)),
    ({"grammar": GBNF}, lambda text: re.fullmatch("(yes|no) [0-9]", text)),
    ({"guided_json": SCHEMA}, lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    ({"json_schema": SCHEMA}, lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
], ids=["guided_choice", "guided_regex", "guided_grammar", "grammar", "guided_json", "json_schema"])
def test_other_servers_constraint_fields_constrain_the_output(server_url, endpoint, fields, check):
    outputs = {_completion(server_url, endpoint, seed, **fields) for seed in SEEDS}
    for text in outputs:
        assert check(text), (fields, text)


def test_without_a_constraint_the_tiny_model_writes_otherwise(server_url):
    """The constraint is what shapes the outputs above: unconstrained, the same requests differ."""
    outputs = [_completion(server_url, "completions", seed) for seed in SEEDS]
    assert not any(re.fullmatch("(yes|no) [0-9]", text) for text in outputs)


@pytest.mark.parametrize("fields, param", [
    ({"grammar": GBNF, "guided_choice": ["a"]}, "grammar"),  # the message names both
    ({"grammar": "root ::= (", "max_tokens": 3}, "grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"mirostat": 2}, "mirostat"),
    ({"typical_p": 0.5}, "typical_p"),
    ({"repeat_penalty": 1.1, "repetition_penalty": 1.2}, "repeat_penalty"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
])
def test_constraints_and_samplers_not_served_are_400s_naming_the_field(server_url, fields, param):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, **fields}
    reply = httpx.post(server_url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()
    assert httpx.get(server_url + "/health").status_code == 200


def test_samplers_sent_switched_off_are_accepted(server_url):
    """llama.cpp's clients send their samplers' fields with every request, mostly switched off."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "typical_p": 1.0, "mirostat": 0, "dry_multiplier": 0}
    assert httpx.post(server_url + "/v1/completions", json=body, timeout=60).status_code == 200


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
    ("/completion", {"prompt": "Hi", "n_predict": 2}),
])
def test_a_json_body_sent_as_curl_sends_it_without_a_content_type_is_read(server_url, route, body):
    """`curl -d '{...}'` labels the body a form: llama-server reads it as JSON, and so does this server."""
    reply = httpx.post(server_url + route, content=json.dumps(body),
                       headers={"content-type": "application/x-www-form-urlencoded"}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert (reply.json().get("usage") or {}).get("completion_tokens", reply.json().get("tokens_predicted")) == 2


def test_llama_servers_web_ui_request_is_served_as_it_means(server_url, tokenizer):
    """What llama-server's web UI sends to /v1/chat/completions: its samplers switched off,
    `max_tokens: -1` (up to the context) and `repeat_penalty` (repetition_penalty's other name)."""
    messages = [{"role": "user", "content": "Hi"}]
    ui = {"model": MODEL, "messages": messages, "cache_prompt": True, "samplers": "edkypmxt", "temperature": 0,
          "dynatemp_range": 0, "dynatemp_exponent": 1, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "typical_p": 1,
          "xtc_probability": 0, "xtc_threshold": 0.1, "repeat_last_n": 64, "repeat_penalty": 1.3,
          "presence_penalty": 0, "frequency_penalty": 0, "dry_multiplier": 0, "dry_base": 1.75,
          "dry_allowed_length": 2, "dry_penalty_last_n": -1, "max_tokens": -1, "timings_per_token": False}
    reply = httpx.post(server_url + "/v1/chat/completions", json=ui, timeout=120)
    assert reply.status_code == 200, reply.text
    ours = {"model": MODEL, "messages": messages, "temperature": 0, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
            "repetition_penalty": 1.3}
    same = httpx.post(server_url + "/v1/chat/completions", json=ours, timeout=120).json()
    assert reply.json()["choices"][0]["message"] == same["choices"][0]["message"]
    plain = httpx.post(server_url + "/v1/chat/completions", json={**ours, "repetition_penalty": 1.0}, timeout=120).json()
    assert plain["choices"][0]["message"] != same["choices"][0]["message"]  # the penalty was applied
