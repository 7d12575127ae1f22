"""Structured outputs, tool calling and token controls over HTTP, with the official `openai`
client against the tiny random model's server: outputs satisfy their constraint streamed and
not; forced tool calls carry arguments valid under the tool's schema; "auto" parses a scripted
Hermes call; bad schemas, regexes and grammars are 400s naming the field, and the server goes on."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.server.common import MODEL


@pytest.fixture(scope="module")
def client(long_context_url):
    return openai.OpenAI(base_url=long_context_url + "/v1", api_key="unused", max_retries=0)


SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5}, "pet": {"enum": ["cat", "dog"]}},
    "required": ["n", "pet"],
}
COMPACT_JSON = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}},
            "required": ["city", "celsius"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_json_schema_holds_streamed_and_not_with_n_3(client):
    full = client.completions.create(model=MODEL, prompt="A pet:", max_tokens=30, n=3, temperature=1.0, seed=1,
                                     extra_body=COMPACT_JSON)
    for choice in full.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    texts = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, n=3, temperature=1.0,
                                                seed=2, stream=True, extra_body=COMPACT_JSON):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert len(texts) == 3
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    "constraint, check",
    [
        ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"grammar": 'root ::= "<" [a-c] [a-c]? [a-c]? ">"'}, lambda t: re.fullmatch(r"<[a-c]{1,3}>", t)),
    ],
)
def test_regex_choice_and_grammar_outputs_match(client, constraint, check):
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                              extra_body={"structured_outputs": constraint})
    text = response.choices[0].message.content
    assert check(text), text
    assert response.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"logit_bias": {"not-a-token": 5}}, "logit_bias"),
        ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_the_field_and_the_server_goes_on(client, body, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=body)
    assert error.value.status_code == 400
    assert error.value.body["param"] == param, error.value.body
    after = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 3


def _arguments_valid(call, tool: dict) -> None:
    assert call.type == "function" and call.id
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_choice_required_returns_calls_valid_under_their_schemas(client):
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK],
                                              tool_choice="required", max_tokens=60, temperature=1.0, seed=3)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls
    tools = {t["function"]["name"]: t for t in (WEATHER, CLOCK)}
    for call in choice.message.tool_calls:
        _arguments_valid(call, tools[call.function.name])


def test_a_named_function_is_called_streamed_and_not(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice=named,
                                              max_tokens=40, temperature=0)
    (call,) = response.choices[0].message.tool_calls
    _arguments_valid(call, WEATHER)
    assert response.choices[0].finish_reason == "tool_calls"
    # Streamed: the first delta names the call, the rest carry its arguments.
    deltas, finish = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice=named,
                                                max_tokens=40, temperature=0, stream=True):
        for choice in chunk.choices:
            deltas.extend(choice.delta.tool_calls or [])
            finish = choice.finish_reason or finish
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].type == "function"
    assert all(d.index == 0 for d in deltas)
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert finish == "tool_calls"


SCRIPTED = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "celsius": true}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_a_scripted_hermes_call(client, stream):
    # The tiny model's output is scripted by a one-choice constraint; tool_choice "auto" parses it.
    body = {"structured_outputs": {"choice": [SCRIPTED]}}
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=80, temperature=0, extra_body=body)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, calls, finish = choice.message.content, choice.message.tool_calls, choice.finish_reason
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Oslo", "celsius": True})
        ]
    else:
        content, calls, finish = "", {}, None  # calls: index -> [name, arguments], from their deltas
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for delta in choice.delta.tool_calls or []:
                    call = calls.setdefault(delta.index, [delta.function.name, ""])
                    call[1] += delta.function.arguments or ""
                finish = choice.finish_reason or finish
        assert "<tool_call>" not in content
        assert [(name, json.loads(arguments)) for name, arguments in calls.values()] == [
            ("get_weather", {"city": "Oslo", "celsius": True})
        ]
    assert content.strip() == "Let me check."
    assert finish == "tool_calls"


def test_tool_messages_and_earlier_calls_reach_the_template(client):
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    with_history = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=1,
                                                  temperature=0)
    without = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=1, temperature=0)
    bare = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0)
    # The tools' description and the exchange each lengthen the prompt the template built.
    assert bare.usage.prompt_tokens < without.usage.prompt_tokens < with_history.usage.prompt_tokens


def test_logit_bias_and_allowed_token_ids_over_http(client):
    plain = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=1, temperature=0, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    token_id = httpx.post(root + "/tokenize", json={"prompt": first, "add_special_tokens": False}).json()["tokens"][0]
    banned = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=1, temperature=0, logprobs=0,
                                       logit_bias={str(token_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != first
    forced = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=1.0, seed=0,
                                       logit_bias={"4321": 100}, extra_body={"ignore_eos": True})
    allowed = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=8, temperature=1.5, seed=0, n=2,
                                        extra_body={"allowed_token_ids": [4321, 1234], "ignore_eos": True})
    tokenized = {t: httpx.post(root + "/detokenize", json={"tokens": [t]}).json()["prompt"] for t in (4321, 1234)}
    assert forced.choices[0].text == tokenized[4321] * 4
    for choice in allowed.choices:
        assert re.fullmatch("(" + "|".join(map(re.escape, tokenized.values())) + ")+", choice.text), choice.text
