"""OpenAI's Responses API (`/v1/responses`) with the official `openai` client against the tiny
random model's server: a response is the chat route's greedy completion of the same
conversation (text and token counts), instructions and item inputs (messages, function calls
and their outputs) render as the chat route's messages, `max_output_tokens` makes a response
incomplete, `text.format` and forced function tools give output valid under their schemas,
`previous_response_id` continues a stored conversation, GET and DELETE, `store: false`, the
streaming event sequence, the store's byte bound, and errors in OpenAI's shape. The oracles are
the chat route, the client's own parser of the documented types, and the schemas."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from pagedllm.cli import build_parser
from pagedllm.entrypoints.openai.responses_store import ResponseStore
from tests.server.common import MODEL, SERVE_FLAGS, start_server_thread


@pytest.fixture(scope="module")
def server(long_context_url):
    return long_context_url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}},
    "required": ["city", "celsius"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": WEATHER_SCHEMA, "strict": True}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                "parameters": WEATHER_SCHEMA}}]
QUESTION = "What is the weather in Paris?"


def _chat(client, messages, max_tokens=8, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kwargs)


# --- plain responses ----------------------------------------------------------------------------


def test_a_plain_response_is_the_chat_routes_greedy_completion(client):
    response = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=8)
    expected = _chat(client, [{"role": "user", "content": QUESTION}])
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert [item.type for item in response.output] == ["message"]
    assert response.output[0].id.startswith("msg_") and response.output[0].role == "assistant"
    assert response.output_text == expected.choices[0].message.content
    assert response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.usage.output_tokens == expected.usage.completion_tokens
    assert response.usage.total_tokens == expected.usage.total_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert response.error is None and response.temperature == 0


def test_max_output_tokens_makes_the_response_incomplete(client):
    response = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.max_output_tokens == 3


def test_instructions_and_item_inputs_render_as_the_chat_routes_messages(client):
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                        {"type": "input_text", "text": "there"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # earlier thinking: dropped
        {"role": "user", "content": "How are you?"},
    ]
    response = client.responses.create(model=MODEL, instructions="You are a bot.", input=items, temperature=0,
                                       max_output_tokens=6)
    messages = [{"role": "system", "content": "You are a bot."}, {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi\nthere"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "How are you?"}]
    expected = _chat(client, messages, max_tokens=6)
    assert response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.output_text == expected.choices[0].message.content
    assert response.instructions == "You are a bot."


def test_text_format_json_schema_output_validates(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10}}, "required": ["answer"],
              "additionalProperties": False}
    response = client.responses.create(
        model=MODEL, input="Answer in JSON.", temperature=0, max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


# --- tools --------------------------------------------------------------------------------------


def _forced_call(client, **kwargs):
    return client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, temperature=0, max_output_tokens=60,
                                   tool_choice={"type": "function", "name": "get_weather"}, **kwargs)


def test_a_forced_function_tool_yields_a_valid_function_call_item(client):
    response = _forced_call(client)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and response.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    # The chat route's forced call of the same conversation: the same arguments and prompt.
    expected = _chat(client, [{"role": "user", "content": QUESTION}], max_tokens=60, tools=CHAT_TOOLS,
                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert call.arguments == expected.choices[0].message.tool_calls[0].function.arguments
    assert response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.tools[0].name == "get_weather"


def test_tool_choice_required_yields_calls_streamed_as_whole(client):
    clock = {"type": "function", "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}
    kwargs = {"model": MODEL, "input": QUESTION, "tools": [*TOOLS, clock], "tool_choice": "required",
              "temperature": 0, "max_output_tokens": 80, "parallel_tool_calls": False}
    response = client.responses.create(**kwargs)
    (call,) = [item for item in response.output if item.type == "function_call"]
    schema = {"get_weather": WEATHER_SCHEMA, "get_time": clock["parameters"]}[call.name]
    jsonschema.validate(json.loads(call.arguments), schema)
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert [(i.type, i.name, i.arguments) for i in final.output] == [("function_call", call.name, call.arguments)]


def test_a_follow_up_with_previous_response_id_continues_the_conversation(client):
    first = _forced_call(client)
    call = next(item for item in first.output if item.type == "function_call")
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=TOOLS, temperature=0, max_output_tokens=6,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"}],
    )
    assert second.previous_response_id == first.id
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees, sunny"},
    ]
    expected = _chat(client, history, max_tokens=6, tools=CHAT_TOOLS)
    assert second.usage.input_tokens == expected.usage.prompt_tokens
    assert second.output_text == (expected.choices[0].message.content or "")


def test_assistant_text_and_its_function_calls_are_one_chat_turn(client):
    arguments = json.dumps({"city": "Paris", "celsius": True})
    items = [
        {"role": "user", "content": QUESTION},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees, sunny"},
    ]
    kwargs = {"model": MODEL, "input": items, "tools": TOOLS, "temperature": 0, "max_output_tokens": 6, "store": False}
    response = client.responses.create(**kwargs)
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    expected = _chat(client, history, max_tokens=6, tools=CHAT_TOOLS)
    assert response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.output_text == (expected.choices[0].message.content or "")
    # Streamed with the tools in "auto": the same text, through the tool-call parser's stream.
    last = list(client.responses.create(stream=True, **kwargs))[-1]
    assert last.type == f"response.{response.status}" and last.response.output_text == response.output_text


def test_get_and_delete_a_stored_response(client):
    created = client.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=4)
    fetched = client.responses.retrieve(created.id)
    assert fetched.id == created.id and fetched.output_text == created.output_text
    assert fetched.usage.output_tokens == created.usage.output_tokens
    deleted = client.responses.delete(created.id)  # the client returns None for its body
    assert deleted is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)


def test_input_items_list_a_responses_conversation_newest_first_by_pages(client, server):
    """With previous_response_id a response's input is the earlier turns' items (their outputs
    included), then its own; the openai client's `input_items.list` pages through them."""
    first = _forced_call(client)
    call = next(item for item in first.output if item.type == "function_call")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees, sunny"}
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=TOOLS, temperature=0,
                                     max_output_tokens=4, input=[result])
    listed = list(client.responses.input_items.list(second.id, order="asc", limit=1))  # one page at a time
    assert [item.type for item in listed] == ["message", *[item.type for item in first.output], "function_call_output"]
    assert listed[0].content[0].text == QUESTION and listed[-1].output == result["output"]
    assert listed[1].id == first.output[0].id  # the earlier output's items keep their ids
    newest_first = client.responses.input_items.list(second.id)
    assert [item.id for item in newest_first.data] == [item.id for item in reversed(listed)]
    assert len({item.id for item in listed}) == len(listed)
    for query, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after")):
        reply = httpx.get(f"{server}/v1/responses/{second.id}/input_items", params=query, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")


def test_store_false_keeps_nothing(client):
    created = client.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


def test_an_unknown_previous_response_id_is_a_404_naming_it(server):
    body = {"model": MODEL, "input": "Hi", "previous_response_id": "resp_nope"}
    reply = httpx.post(server + "/v1/responses", json=body)
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["param"] == "previous_response_id" and "resp_nope" in error["message"]


def test_errors_name_the_field(server):
    bad_tool = {"model": MODEL, "input": "Hi", "tools": [{"type": "web_search"}]}
    reply = httpx.post(server + "/v1/responses", json=bad_tool)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "tools" and "web_search" in reply.json()["error"]["message"]
    bad_item = {"model": MODEL, "input": [{"type": "input_image", "image_url": "x"}]}
    reply = httpx.post(server + "/v1/responses", json=bad_item)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input"
    bad_choice = {"model": MODEL, "input": "Hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}
    reply = httpx.post(server + "/v1/responses", json=bad_choice)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tool_choice"


# --- streaming ----------------------------------------------------------------------------------


def test_streamed_events_concatenate_to_the_non_streamed_text(client):
    kwargs = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 8}
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and final.id == events[0].response.id


def test_a_streamed_forced_call_streams_its_arguments(client):
    manager = client.responses.stream(
        model=MODEL, input=QUESTION, tools=TOOLS, temperature=0, max_output_tokens=60,
        tool_choice={"type": "function", "name": "get_weather"},
    )
    with manager as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[2] == "response.output_item.added" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    deltas = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert deltas == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    assert call.arguments == _forced_call(client).output[0].arguments


# --- the store's bound --------------------------------------------------------------------------


def test_the_store_drops_the_least_recently_used_past_its_bound():
    items = [{"id": "msg_1", "role": "user", "content": "y" * 40}]  # (an item without an id is given one)
    entry_bytes = len(json.dumps({"id": "a", "pad": "x" * 60})) + len(json.dumps(items))
    store = ResponseStore(max_bytes=3 * entry_bytes)  # room for three entries
    for name in ("a", "b", "c"):
        assert store.put({"id": name, "pad": "x" * 60}, items)
    assert store.num_bytes == 3 * entry_bytes
    assert store.get("a") is not None  # now the most recently used
    store.put({"id": "d", "pad": "x" * 60}, items)
    assert store.get("b") is None and store.get("a") is not None and store.get("d") is not None
    assert store.num_bytes == 3 * entry_bytes and len(store) == 3
    assert not store.put({"id": "huge", "pad": "x" * 4 * entry_bytes}, [])  # larger than the bound alone


def test_a_server_with_a_tiny_store_bound_answers_404_for_a_dropped_response(tiny_llama):
    args = build_parser().parse_args(
        ["serve", str(tiny_llama), "--port", "0", *SERVE_FLAGS, "--responses-store-bytes", "6KiB"]
    )
    server, thread, url = start_server_thread(args)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        ids = [client.responses.create(model=MODEL, input=f"Hi {i}", temperature=0, max_output_tokens=2).id
               for i in range(6)]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(ids[0])  # the oldest went first
        assert client.responses.retrieve(ids[-1]).id == ids[-1]
        with pytest.raises(openai.NotFoundError) as caught:
            client.responses.create(model=MODEL, input="Again", previous_response_id=ids[0])
        assert ids[0] in str(caught.value)
    finally:
        server.should_exit = True
        thread.join(30)


def test_max_output_tokens_past_the_context_is_a_400_naming_it(server):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 100_000}
    reply = httpx.post(server + "/v1/responses", json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_output_tokens"


def test_an_engine_failure_mid_stream_is_the_streams_last_event_an_error():
    from pagedllm.engine.async_llm_engine import EngineDeadError
    from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
    from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses
    from pagedllm.sampling_params import SamplingParams

    async def failing():
        raise EngineDeadError("the engine died")
        yield  # an async generator

    request = ResponsesRequest(model=MODEL, input="Hi")
    serving = OpenAIServingResponses(chat=None, request_fields=None, store=ResponseStore())
    head = {"id": "resp_1", "object": "response", "created_at": 0, "model": MODEL, **request.echo_fields()}

    async def collect():
        events = serving._stream(request, "none", None, SamplingParams(), head, [], failing(), None)
        return [item async for item in events]

    import asyncio

    events = [json.loads(item.split("data: ", 1)[1]) for item in asyncio.run(collect())]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"]
    assert events[-1]["code"] == "engine_dead" and "the engine died" in events[-1]["message"]
    assert [e["sequence_number"] for e in events] == [0, 1, 2]
    assert serving.store.get("resp_1") is None  # a failed response is not stored
