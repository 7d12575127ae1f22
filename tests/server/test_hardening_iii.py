"""Hardening III (issue 51): a body nested deeper than the limit is a 400 naming the field (it
was a RecursionError, a 500, at 400-980 levels), beam search takes any finite length penalty
(it failed the step with OverflowError or ZeroDivisionError) and returns real logprobs (it
returned placeholders), seeds outside 64 bits are refused instead of wrapped, two messages name
what was actually sent, a grammar no string satisfies is a 400 (it generated forbidden tokens
with a warning line each), a request of many prompts is capped, and a large prompt past the
context is refused once its pieces count more tokens than the context (it was tokenized whole).
The cases that need a victim stream or the default model's sizes are in tests/reliability
(test_hostage.py), the signals in test_shutdown.py, /metrics in test_metrics.py."""

from __future__ import annotations

import json

import httpx
import pytest

from pagedllm.entrypoints.openai.protocol import MAX_NESTING
from tests.server.common import MODEL


def _nested(depth: int, leaf=1):
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def _schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, **body}, timeout=60)


def _deep_list(depth: int) -> str:
    """A JSON list nested `depth` deep, as text (httpx's encoder itself recurses past ~900)."""
    return "[" * depth + "1" + "]" * depth


@pytest.mark.parametrize("field, value", [
    ("anything", _deep_list(500)),  # an unknown field
    ("anything", _deep_list(980)),
    ("logit_bias", '{"a": ' + _deep_list(400) + "}"),
    ("response_format", json.dumps({"type": "json_schema", "json_schema": {"name": "s", "schema": _schema(150)}})),
    ("structured_outputs", json.dumps({"json": _schema(300)})),
])
def test_a_body_nested_past_the_limit_is_a_400_naming_the_field(server_url, field, value):
    body = '{"model": "%s", "prompt": "Hi", "max_tokens": 2, "%s": %s}' % (MODEL, field, value)
    reply = httpx.post(server_url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=60)
    assert reply.status_code == 400, reply.text[:500]
    error = reply.json()["error"]
    # Past what the JSON parser itself walks (~980 levels) the body cannot be read: no field to name.
    unread = "too deeply to be read" in error["message"]
    assert unread or (field in error["message"] and (error["param"] or "").startswith(field)), error
    assert len(reply.text) < 2000  # no traceback, no echo of the whole body
    assert httpx.get(server_url + "/health").status_code == 200


def test_a_body_nested_within_the_limit_is_served(server_url):
    assert _post(server_url, {"anything": _nested(MAX_NESTING - 5)}).status_code == 200


@pytest.mark.parametrize("penalty", [400.0, 1e308, -1e308, -400.0])
def test_beam_search_takes_any_finite_length_penalty(server_url, penalty):
    reply = _post(server_url, {"use_beam_search": True, "n": 2, "best_of": 2, "temperature": 0,
                               "length_penalty": penalty, "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == 2


def test_length_penalized_scores_order_as_transformers_formula_where_it_is_finite():
    from pagedllm.engine.beam_search import length_penalized_score as score

    assert score(-3.0, 5, 1.0) == -3.0 / 5
    assert score(-3.0, 5, 400.0) > score(-3.0, 4, 400.0)  # a longer hypothesis is favoured, as -3/5**400 > -3/4**400
    assert score(-3.0, 5, -1e308) == float("-inf") and score(-3.0, 5, 1e308) == 0.0


@pytest.mark.parametrize("seed, ok", [(2**64, False), (-1, False), (2**64 - 1, True), (0, True)])
def test_seeds_outside_64_bits_are_refused_not_wrapped(server_url, seed, ok):
    reply = _post(server_url, {"seed": seed, "temperature": 1.0})
    assert reply.status_code == (200 if ok else 400), reply.text
    if not ok:
        assert reply.json()["error"]["param"] == "seed" and "[0, 2**64)" in reply.json()["error"]["message"]


def test_n_above_1_with_greedy_sampling_names_n(server_url):
    reply = _post(server_url, {"n": 2, "temperature": 0})
    assert reply.status_code == 400
    assert "SamplingParams.n must be 1 with greedy sampling" in reply.json()["error"]["message"]
    assert "best_of" not in reply.json()["error"]["message"]


def test_a_text_part_without_text_says_so(server_url):
    messages = [{"role": "user", "content": [{"type": "text", "text": None}]}]
    reply = httpx.post(server_url + "/v1/chat/completions", json={"model": MODEL, "messages": messages}, timeout=60)
    assert reply.status_code == 400 and "needs its text" in reply.json()["error"]["message"], reply.text


@pytest.mark.parametrize("field, value", [
    ("grammar", "root ::= root root"),
    ("structured_outputs", {"grammar": "root ::= a\na ::= a \"x\""}),
    ("grammar", "root ::= r\nr ::= \"y\" r"),  # its strings start but never end
    ("response_format", {"type": "json_schema", "json_schema": {"name": "loop", "schema": {
        "type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}}}),
])
def test_a_grammar_no_string_satisfies_is_a_400_naming_it(server_url, field, value):
    reply = _post(server_url, {field: value, "max_tokens": 5})
    assert reply.status_code == 400, reply.text
    assert "accepts no string" in reply.json()["error"]["message"]
    assert reply.json()["error"]["param"].startswith(field)


@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "never", "schema": False}}),
    ("json_schema", False),  # llama.cpp's field
])
def test_the_schema_false_is_refused_naming_its_field_and_true_is_any_json(server_url, field, value):
    """JSON Schema's boolean schemas: `false` admits no value (a 400 naming the field, not one
    naming an internal field with no param), `true` any value."""
    reply = _post(server_url, {field: value, "max_tokens": 5})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text
    assert "no value satisfies" in reply.json()["error"]["message"]
    anything = value | {"json_schema": {"name": "any", "schema": True}} if isinstance(value, dict) else True
    reply = _post(server_url, {field: anything, "max_tokens": 12, "temperature": 0})
    assert reply.status_code == 200, reply.text
    text = reply.json()["choices"][0]["text"]
    if reply.json()["choices"][0]["finish_reason"] == "stop":
        json.loads(text)


def test_an_output_whose_constraints_allow_no_token_ends_there_once(server_url, tokenizer):
    """A grammar and allowed_token_ids that no token satisfies together: the output ends after the
    one forbidden draw (it went on to max_tokens, a forbidden token and a warning line each step)."""
    only = tokenizer.encode("zebra", add_special_tokens=False)[:1]
    reply = _post(server_url, {"grammar": 'root ::= "yes" | "no"', "allowed_token_ids": only, "max_tokens": 6})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 1
    assert reply.json()["choices"][0]["finish_reason"] == "stop"


def test_a_request_starting_more_sequences_than_the_limit_is_refused_before_any_work(server_url):
    """Issue 51 item 3: one request of 1,000 prompts x n=16 made a later stream wait 95 s."""
    import time

    over = _post(server_url, {"prompt": ["Hi"] * 17, "n": 16, "temperature": 1.0, "max_tokens": 1})
    assert over.status_code == 400 and "--max-seqs-per-request" in over.json()["error"]["message"], over.text
    assert "272 sequences (17 prompts x 16 each)" in over.json()["error"]["message"]
    start = time.monotonic()
    huge = _post(server_url, {"prompt": ["Hi there"] * 50_000, "max_tokens": 1})
    assert huge.status_code == 400 and time.monotonic() - start < 5  # refused before tokenizing 50,000 prompts
    at = _post(server_url, {"prompt": ["Hi"] * 16, "n": 16, "temperature": 1.0, "max_tokens": 1})
    assert at.status_code == 200 and len(at.json()["choices"]) == 256, at.text[:300]


@pytest.mark.parametrize("stream", [False, True])
def test_beam_search_logprobs_are_real_in_completions_and_chat(server_url, stream):
    """Issue 51 item 4: beam search with logprobs answered placeholders (tokens "", token_logprobs
    null, chat logprob -9999.0) on every model, streamed or not."""
    beam = {"use_beam_search": True, "n": 2, "best_of": 2, "temperature": 0, "max_tokens": 4, "ignore_eos": True,
            "stream": stream}
    completion = httpx.post(server_url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "logprobs": 2, **beam},
                            timeout=60)
    chat = httpx.post(server_url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 2, **beam})
    assert completion.status_code == chat.status_code == 200, (completion.text, chat.text)
    if stream:
        events = [json.loads(line[6:]) for line in completion.text.splitlines() if line.startswith("data: {")]
        choices = [c for e in events for c in e["choices"] if c.get("logprobs")]
        chat_events = [json.loads(line[6:]) for line in chat.text.splitlines() if line.startswith("data: {")]
        chat_choices = [c for e in chat_events for c in e["choices"] if c.get("logprobs")]
    else:
        choices, chat_choices = completion.json()["choices"], chat.json()["choices"]
    tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
    values = [v for c in choices for v in c["logprobs"]["token_logprobs"]]
    assert len(tokens) == 8 and all(t != "" for t in tokens), choices
    assert all(v is not None and -50 < v <= 0 for v in values), values
    assert all(len(top) >= 2 for c in choices for top in c["logprobs"]["top_logprobs"])
    content = [entry for c in chat_choices for entry in c["logprobs"]["content"]]
    assert len(content) == 8 and all(-50 < e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 for e in content), content


def _texts(seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    words = ["the", "history", "日本語の文章", "Ölçü", "🙂🙂", "x" * 40, "naïve", "1234567", "\n", "  ", "def f():"]
    spaced = " ".join(rng.choice(words) for _ in range(20_000))
    unspaced = "".join(rng.choice(words) for _ in range(20_000))  # pieces cut inside words
    return [spaced, unspaced, "a" * 90_000, "日本" * 40_000, spaced[:40_000]]


@pytest.mark.parametrize("max_model_len", [256, 2048, 16_000, 60_000])
def test_counting_a_large_text_by_pieces_never_refuses_a_prompt_that_fits(tokenizer, max_model_len):
    """Issue 51 item 2: a large text is counted a piece at a time and refused once its pieces
    hold more tokens than the context (a 5 MB prompt was tokenized whole, 2.4M tokens, before
    its refusal). The count is sound: refused means the whole text really has at least
    max_model_len tokens; and it stops early, having read little more than the context's worth."""
    from pagedllm.entrypoints.openai.serving_base import COUNT_PIECE_CHARS, OpenAIServing

    serving = OpenAIServing.__new__(OpenAIServing)
    serving.tokenizer, serving.max_model_len = tokenizer, max_model_len
    for text in _texts(max_model_len):
        whole = len(tokenizer.encode(text, add_special_tokens=False))
        counted = serving._count_past_context(text)
        if counted is not None:
            tokens, chars = counted
            assert whole >= max_model_len, (whole, counted)
            assert chars < len(text) or whole >= max_model_len
            prefix = len(tokenizer.encode(text[:chars], add_special_tokens=False))
            assert prefix <= max_model_len + 2 * COUNT_PIECE_CHARS  # stopped within a piece past the context
        else:
            assert whole < max_model_len + 4 * (len(text) // 8192 + 1), (whole, max_model_len)


def test_a_large_prompt_past_the_context_is_refused_naming_it(server_url):
    text = "日本語の文章 " * 5700  # 39,900 characters (a large text), ~11,000 tokens: past the tiny server's 256
    reply = _post(server_url, {"prompt": text})
    assert reply.status_code == 400, reply.text[:300]
    error = reply.json()["error"]
    assert error["param"] == "prompt" and "more tokens than this model's context of 256" in error["message"], error
    counted = httpx.post(server_url + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=60)
    assert counted.status_code == 200 and counted.json()["count"] > 256  # /tokenize counts any text in its bound
