"""The Hermes tool-call parser and the tool-call streamer, alone: calls are found in the
model's text, content before them is streamed as soon as it surely is content, a half-written
tag is held back, and a malformed call leaves the text as content."""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tools import HermesToolParser, ToolCallStreamer, template_conversation, tool_call_schema

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


def test_calls_are_extracted_with_the_content_before_them():
    content, calls = HermesToolParser().extract("Sure. " + CALL + "\n" + CALL.replace('"x": 1', '"x": 2'))
    assert content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("f", {"x": 2})]
    assert len({c.id for c in calls}) == 2


def test_a_malformed_call_leaves_the_whole_text_as_content():
    text = 'Hi <tool_call>{"name": "f", "arguments": </tool_call>'
    assert HermesToolParser().extract(text) == (text, [])


def test_an_unclosed_final_call_still_counts():
    content, calls = HermesToolParser().extract('<tool_call>{"name": "f", "arguments": {}}')
    assert content is None and [c.name for c in calls] == ["f"]


def test_a_half_written_tag_is_held_back_from_the_stream():
    parser = HermesToolParser()
    assert parser.content_end("Hello <tool") == len("Hello ")
    assert parser.content_end("Hello <b>") == len("Hello <b>")
    assert parser.content_end("Hi " + CALL[:20]) == len("Hi ")


def test_auto_streaming_sends_content_then_the_calls():
    streamer = ToolCallStreamer("auto")
    pieces = []
    text = "Sure. " + CALL
    for i in range(0, len(text), 5):
        new, finish = streamer.feed(0, text[i : i + 5], None)
        pieces.extend(new)
    new, finish = streamer.feed(0, "", "stop")
    pieces.extend(new)
    assert "".join(p.get("content", "") for p in pieces) == "Sure. "
    call_deltas = [p["tool_calls"][0] for p in pieces if "tool_calls" in p]
    assert call_deltas[0]["function"]["name"] == "f" and "id" in call_deltas[0]
    assert all("id" not in d for d in call_deltas[1:])  # the id and name once
    assert len(call_deltas) > 2  # the arguments arrive as they grow, not only at the end
    assert "".join(d["function"].get("arguments", "") for d in call_deltas) == '{"x": 1}'
    assert finish == "tool_calls"


def test_required_allows_only_calls_of_the_given_tools():
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("a", "b")]
    schema = tool_call_schema(tools, "required", parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == [["a"], ["b"]]


def test_a_template_without_tools_sees_them_described_and_calls_as_text():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    conversation = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    seen = template_conversation(conversation, tools, "{{ messages }}")
    assert seen[0]["role"] == "system" and '"name": "f"' in seen[0]["content"]
    assert seen[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert seen[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
    # A template that knows tools gets the messages unchanged (the tools go beside them).
    assert template_conversation(conversation, tools, "{{ tools }} {{ m.tool_calls }}") == conversation
