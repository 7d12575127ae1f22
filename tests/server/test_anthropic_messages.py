"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) with the official
`anthropic` client against the tiny random model's server (with an API key): a message is the
chat route's greedy completion of the same conversation (text and token counts), system
prompts, multi-turn history and tool results reach the chat template as the chat route sends
them, stop reasons, Anthropic's streaming event sequence, forced tool calls valid under their
input schemas, `x-api-key` auth, and errors in Anthropic's shape. The oracles are the chat
route, transformers' chat template, Anthropic's documented shapes and the tools' schemas."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from pagedllm.cli import build_parser
from pagedllm.engine.async_llm_engine import EngineDeadError
from pagedllm.entrypoints.openai.serving_anthropic import (
    MessageEvents,
    MessageStream,
    _ending_with_error_event,
    content_blocks,
)
from tests.server.common import MODEL, SERVE_FLAGS, start_server_thread

KEY = "sk-test-anthropic"


@pytest.fixture(scope="module")
def server(tiny_llama):
    """The tiny model's server with an API key and room for the tools' description."""
    args = build_parser().parse_args(
        ["serve", str(tiny_llama), "--port", "0", *SERVE_FLAGS, "--max-model-len", "1024", "--api-key", KEY]
    )
    server, thread, url = start_server_thread(args)
    yield url
    server.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"],
}
CLOCK_SCHEMA = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA},
    {"name": "get_time", "description": "The time in a zone", "input_schema": CLOCK_SCHEMA},
]
# The same tools as the chat route takes them.
CHAT_TOOLS = [
    {"type": "function", "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
    for t in TOOLS
]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
# The newest clients take no sampling fields; Anthropic's API (and this server) still read them.
GREEDY = {"temperature": 0}


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def _stop_reason(finish_reason: str) -> str:
    """Anthropic's stop reason for a chat finish reason without a stop string (its documentation)."""
    return {"length": "max_tokens", "stop": "end_turn", "tool_calls": "tool_use"}[finish_reason]


# --- plain messages ---------------------------------------------------------------------------


def test_a_plain_message_is_the_chat_routes_greedy_completion(claude, chat):
    message = claude.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=USER)
    expected = chat.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=USER)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL
    assert [block.type for block in message.content] == ["text"]
    assert _text(message) == expected.choices[0].message.content
    assert message.usage.input_tokens == expected.usage.prompt_tokens
    assert message.usage.output_tokens == expected.usage.completion_tokens
    assert message.stop_reason == _stop_reason(expected.choices[0].finish_reason)
    assert message.stop_sequence is None


def test_system_and_multi_turn_history_render_through_the_chat_template(claude, chat, tokenizer):
    system = [{"type": "text", "text": "You answer briefly."}, {"type": "text", "text": "In French."}]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "How are you?"},
    ]
    counted = claude.messages.count_tokens(model=MODEL, system=system, messages=messages)
    conversation = [{"role": "system", "content": "You answer briefly.\nIn French."},
                    {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Bonjour"},
                    {"role": "user", "content": "How are you?"}]
    expected = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert counted.input_tokens == len(expected)
    # The same prompt: the same greedy continuation as transformers' prompt ids on /v1/completions.
    message = claude.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY, system=system, messages=messages)
    assert message.usage.input_tokens == len(expected)
    completion = chat.completions.create(model=MODEL, prompt=expected, max_tokens=6, temperature=0)
    assert _text(message) == completion.choices[0].text


def test_tool_use_and_tool_result_history_is_the_chat_routes_conversation(claude, chat):
    messages = [
        *USER,
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris", "celsius": True}},
            {"type": "tool_use", "id": "toolu_02", "name": "get_time", "input": {"zone": "CET"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "18 degrees, sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_02", "content": [{"type": "text", "text": "14:05"}]},
            {"type": "text", "text": "And tomorrow?"},
        ]},
    ]
    chat_messages = [
        *USER,
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "toolu_01", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "celsius": True})}},
            {"id": "toolu_02", "type": "function", "function": {"name": "get_time", "arguments": json.dumps({"zone": "CET"})}},
        ]},
        {"role": "tool", "tool_call_id": "toolu_01", "content": "18 degrees, sunny"},
        {"role": "tool", "tool_call_id": "toolu_02", "content": "14:05"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    system = "Be helpful."
    message = claude.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, system=system, tools=TOOLS,
                                     messages=messages)
    expected = chat.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, tools=CHAT_TOOLS,
                                            messages=[{"role": "system", "content": system}, *chat_messages])
    assert message.usage.input_tokens == expected.usage.prompt_tokens
    assert _text(message) == (expected.choices[0].message.content or "")
    counted = claude.messages.count_tokens(model=MODEL, system=system, tools=TOOLS, messages=messages)
    assert counted.input_tokens == expected.usage.prompt_tokens


def test_count_tokens_equals_the_chat_routes_prompt_tokens(claude, chat):
    expected = chat.chat.completions.create(model=MODEL, max_tokens=1, messages=USER, tools=CHAT_TOOLS)
    assert claude.messages.count_tokens(model=MODEL, messages=USER, tools=TOOLS).input_tokens == expected.usage.prompt_tokens
    plain = chat.chat.completions.create(model=MODEL, max_tokens=1, messages=USER)
    assert claude.messages.count_tokens(model=MODEL, messages=USER).input_tokens == plain.usage.prompt_tokens


# --- stop reasons -----------------------------------------------------------------------------


def test_max_tokens_and_stop_sequences_set_the_stop_reason(claude, chat):
    full = chat.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, messages=USER).choices[0].message.content
    cut = claude.messages.create(model=MODEL, max_tokens=3, extra_body=GREEDY, messages=USER)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"the tiny model's text {full!r} has no stop sequence to pick"
    message = claude.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=USER, stop_sequences=["@@@", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert _text(message) == full[: full.index(stop)]


# --- streaming --------------------------------------------------------------------------------


def _events(claude, **kwargs) -> list:
    with claude.messages.create(stream=True, **kwargs) as stream:
        return list(stream)


def test_streamed_events_come_in_anthropics_order_and_add_up_to_the_message(claude):
    kwargs = dict(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=USER)
    message = claude.messages.create(**kwargs)
    events = _events(claude, **kwargs)
    types = [e.type for e in events]  # the client drops pings (their place: test_each_sse_event_is_named_...)
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    start = events[0].message
    assert start.id.startswith("msg_") and start.content == [] and start.stop_reason is None
    assert start.usage.input_tokens == message.usage.input_tokens
    assert events[1].index == 0 and events[1].content_block.type == "text"
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert {d.type for d in deltas} == {"text_delta"}
    assert "".join(d.text for d in deltas) == _text(message)
    assert events[-2].delta.stop_reason == message.stop_reason
    assert events[-2].usage.output_tokens == message.usage.output_tokens


def test_a_streamed_stop_sequence_cuts_the_text_where_the_message_does(claude):
    full = _text(claude.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=USER))
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    kwargs = dict(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=USER, stop_sequences=[stop])
    with claude.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == _text(claude.messages.create(**kwargs)) == full[: full.index(stop)]
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_each_sse_event_is_named_by_its_data_type_and_a_ping_follows_the_first_block(server):
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": USER, "stream": True}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", server + "/v1/messages", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    names = []
    for frame in [frame for frame in raw.split("\n\n") if frame]:
        name_line, data_line = frame.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: ")
        names.append(name_line[len("event: "):])
        assert json.loads(data_line[len("data: "):])["type"] == names[-1]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


# --- tool use ---------------------------------------------------------------------------------


def test_a_forced_tool_is_called_with_input_valid_under_its_schema(claude):
    kwargs = dict(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=USER, tools=TOOLS,
                  tool_choice={"type": "tool", "name": "get_weather"})
    message = claude.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    assert isinstance(call.input, dict)
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    # Streamed: a tool_use block whose input_json deltas add up to the same input.
    events = _events(claude, **kwargs)
    (start,) = [e for e in events if e.type == "content_block_start"]
    assert start.content_block.type == "tool_use" and start.content_block.name == "get_weather"
    assert start.content_block.id.startswith("toolu_")
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert {e.delta.type for e in events if e.type == "content_block_delta"} == {"input_json_delta"}
    assert json.loads(partial) == call.input
    assert events[-2].delta.stop_reason == "tool_use"


def test_tool_choice_any_calls_declared_tools_validly(claude):
    message = claude.messages.create(model=MODEL, max_tokens=100, extra_body=GREEDY, messages=USER, tools=TOOLS,
                                     tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert message.stop_reason == "tool_use"
    calls = [block for block in message.content if block.type == "tool_use"]
    assert len(calls) == 1
    schemas = {t["name"]: t["input_schema"] for t in TOOLS}
    jsonschema.validate(calls[0].input, schemas[calls[0].name])
    final = None
    with claude.messages.stream(model=MODEL, max_tokens=100, extra_body=GREEDY, messages=USER, tools=TOOLS,
                                tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    for call in final.content:
        assert call.type == "tool_use"
        jsonschema.validate(call.input, schemas[call.name])


def test_an_output_format_constrains_the_text_to_its_json_schema(claude):
    schema = {**WEATHER_SCHEMA, "additionalProperties": False}
    output_config = {"format": {"type": "json_schema", "schema": schema}}  # a keyword of the newest clients only
    message = claude.messages.create(model=MODEL, max_tokens=40, messages=USER,
                                     extra_body={**GREEDY, "output_config": output_config})
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(_text(message)), schema)


# --- auth ---------------------------------------------------------------------------------------


def test_the_key_is_taken_as_x_api_key_or_bearer_and_refused_otherwise(server):
    kwargs = dict(model=MODEL, max_tokens=1, messages=USER)
    assert anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0).messages.create(**kwargs).usage.output_tokens == 1
    bearer = anthropic.Anthropic(base_url=server, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(**kwargs).usage.output_tokens == 1
    with pytest.raises(anthropic.AuthenticationError) as error:
        anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0).messages.create(**kwargs)
    assert error.value.status_code == 401 and error.value.body["type"] == "error"
    assert error.value.body["error"]["type"] == "authentication_error"
    response = httpx.post(server + "/v1/messages/count_tokens", json={"model": MODEL, "messages": USER})
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"


# --- errors -------------------------------------------------------------------------------------


def _post(server: str, body: dict) -> httpx.Response:
    return httpx.post(server + "/v1/messages", json=body, headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                      timeout=60)


def _anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind
    return body["error"]["message"]


def test_a_missing_max_tokens_is_a_400_naming_it(server):
    message = _anthropic_error(_post(server, {"model": MODEL, "messages": USER}), 400, "invalid_request_error")
    assert "max_tokens" in message


def test_an_unknown_model_is_a_404_not_found_error(server, claude):
    message = _anthropic_error(_post(server, {"model": "claude-nope", "max_tokens": 4, "messages": USER}), 404,
                               "not_found_error")
    assert "claude-nope" in message
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nope", max_tokens=4, messages=USER)


def test_an_image_block_is_a_400_naming_its_place(server, claude):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]
    message = _anthropic_error(_post(server, {"model": MODEL, "max_tokens": 4, "messages": messages}), 400,
                               "invalid_request_error")
    assert "messages[0].content[1]" in message and "image" in message
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=4, messages=messages)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
        ({"stop_sequences": [""]}, "stop_sequences"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"tools": [{"name": "web_search", "type": "web_search_20250305"}]}, "tools[0]"),
    ],
)
def test_bad_fields_are_400s_naming_the_field(server, body, field):
    message = _anthropic_error(_post(server, {"model": MODEL, "max_tokens": 4, "messages": USER, **body}), 400,
                               "invalid_request_error")
    assert field in message


def test_unknown_fields_and_the_version_header_are_accepted(claude):
    message = claude.messages.create(model=MODEL, max_tokens=2, messages=USER, metadata={"user_id": "u1"},
                                     extra_body={"service_tier": "auto", "some_future_field": {"x": 1}})
    assert message.usage.output_tokens == 2


def test_the_openai_routes_keep_openais_error_shape(chat):
    with pytest.raises(openai.NotFoundError) as error:
        chat.chat.completions.create(model="claude-nope", max_tokens=1, messages=USER)
    assert set(error.value.body) >= {"message", "type", "param", "code"}


def test_the_openapi_document_gives_anthropics_error_shape(server):
    document = httpx.get(server + "/openapi.json").json()
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        schema = document["paths"][path]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
        assert schema["$ref"].endswith("/AnthropicErrorResponse"), path


# --- the stream's pieces alone -----------------------------------------------------------------


def _parsed(events: list[str]) -> list[tuple[str, dict]]:
    frames = []
    for item in events:
        name, data = item.removesuffix("\n\n").split("\n")
        frames.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return frames


def test_thinking_then_text_then_a_tool_call_each_get_a_block_of_their_own():
    events = MessageEvents()
    items = [*events.thinking("Hmm"), *events.thinking(" ok"), *events.text("Hi"),
             *events.tool_use("toolu_1", "f"), *events.input_json('{"a": 1}'), *events.finish("tool_use", None, 9)]
    frames = _parsed(items)
    assert [name for name, _ in frames] == [
        "content_block_start", "ping", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop",
    ]
    assert frames[0][1]["content_block"]["type"] == "thinking" and frames[0][1]["index"] == 0
    assert frames[3][1]["delta"] == {"type": "thinking_delta", "thinking": " ok"}
    assert frames[5][1]["index"] == 1 and frames[5][1]["content_block"] == {"type": "text", "text": ""}
    assert frames[8][1]["content_block"] == {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    assert frames[9][1] == {"type": "content_block_delta", "index": 2,
                            "delta": {"type": "input_json_delta", "partial_json": '{"a": 1}'}}
    assert frames[11][1] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                             "usage": {"output_tokens": 9}}


def test_an_engine_failure_after_the_start_is_an_error_event_that_ends_the_stream():
    async def failing():
        yield "event: message_start\ndata: {}\n\n"
        raise EngineDeadError("the engine died")

    async def collect():
        return [item async for item in _ending_with_error_event(failing())]

    items = asyncio.run(collect())
    assert len(items) == 2
    name, body = _parsed(items[1:])[0]
    assert name == "error" and body["type"] == "error" and body["error"]["type"] == "overloaded_error"
    assert "the engine died" in body["error"]["message"]


HERMES = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "celsius": true}}\n</tool_call>'
NOT_AN_OBJECT = 'Hm <tool_call>\n{"name": "get_weather", "arguments": "Oslo"}\n</tool_call>'


def _streamed(text: str, mode: str) -> list[tuple[str, dict]]:
    message = MessageStream(mode)
    items = message.start({"id": "msg_1"})
    for i in range(0, len(text), 7):
        items += message.feed(text[i : i + 7], None, None, 0)
    return _parsed(items + message.feed("", "stop", None, 30))


def test_an_auto_hermes_call_is_a_text_block_and_a_tool_use_block_whole_and_streamed():
    blocks, finish = content_blocks(HERMES, "stop", "auto")
    assert finish == "tool_calls"
    assert blocks[0] == {"type": "text", "text": "Let me check."}
    assert blocks[1]["type"] == "tool_use" and blocks[1]["id"].startswith("toolu_")
    assert (blocks[1]["name"], blocks[1]["input"]) == ("get_weather", {"city": "Oslo", "celsius": True})
    frames = _streamed(HERMES, "auto")
    deltas = [body["delta"] for name, body in frames if name == "content_block_delta"]
    assert "".join(d["text"] for d in deltas if d["type"] == "text_delta").strip() == "Let me check."
    assert json.loads("".join(d["partial_json"] for d in deltas if d["type"] == "input_json_delta")) == {
        "city": "Oslo", "celsius": True}
    (tool_start,) = [body for name, body in frames if name == "content_block_start" and body["index"] == 1]
    assert tool_start["content_block"]["name"] == "get_weather"
    assert frames[-2][1]["delta"]["stop_reason"] == "tool_use" and frames[-2][1]["usage"] == {"output_tokens": 30}


def test_a_call_whose_arguments_are_no_object_leaves_the_output_as_text_whole_and_streamed():
    assert content_blocks(NOT_AN_OBJECT, "stop", "auto") == ([{"type": "text", "text": NOT_AN_OBJECT}], "stop")
    frames = _streamed(NOT_AN_OBJECT, "auto")
    assert "".join(body["delta"]["text"] for name, body in frames if name == "content_block_delta") == NOT_AN_OBJECT
    assert {body["content_block"]["type"] for name, body in frames if name == "content_block_start"} == {"text"}
    assert frames[-2][1]["delta"]["stop_reason"] == "end_turn"


@pytest.mark.parametrize(
    ("finish_reason", "engine_stop", "expected"),
    [("stop", None, ("end_turn", None)), ("stop", 2, ("end_turn", None)), ("stop", "##", ("stop_sequence", "##")),
     ("length", None, ("max_tokens", None))],
)
def test_stop_reasons_follow_anthropics_documentation(finish_reason, engine_stop, expected):
    message = MessageStream("none")
    frames = _parsed(message.feed("Hi", finish_reason, engine_stop, 1))
    assert (frames[-2][1]["delta"]["stop_reason"], frames[-2][1]["delta"]["stop_sequence"]) == expected
