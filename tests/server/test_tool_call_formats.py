"""Every `--tool-call-parser` format alone, on hand-written model texts: calls found with the
content before them, several calls, and malformed, unknown-name or cut calls left whole as
content; streamed char by char and in random splits, the deltas add up to what the whole text
parses to (the content, each call's id and name once, its arguments as they grow)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.entrypoints.openai.tools import ToolCallStreamer, tool_functions

TOOLS = tool_functions([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
])
WEATHER = ("get_weather", {"city": "Paris", "days": 2})
TIME = ("get_time", {"zone": "CET"})
QWEN_WEATHER = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
QWEN_TIME = "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>"

# (format, model text, the content, the calls): hand-written, each a call list a model writes.
WELL_FORMED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
     None, [WEATHER]),
    ("hermes", 'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>', "Let me look.", [WEATHER, TIME]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', None, [WEATHER]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
     '{"name": "get_time", "parameters": {"zone": "CET"}}', None, [WEATHER, TIME]),
    ("llama3_json", 'Checking. <|python_tag|>{"name": "get_time", "arguments": {"zone": "CET"}}', "Checking.", [TIME]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]', None, [WEATHER]),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
     '{"name": "get_time", "arguments": {"zone": "CET"}, "id": "abc123xyz"}]', "Sure.", [WEATHER, TIME]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
     "Sure.", [WEATHER, TIME]),
    ("mistral", '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "CET"}', None, [TIME]),
    # The special tokens skipped from the text: the list, or each name and its arguments.
    ("mistral", ' [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]', None, [WEATHER]),
    ("mistral", 'get_weather{"city": "Paris", "days": 2}get_time{"zone": "CET"}', None, [WEATHER, TIME]),
    ("pythonic", '[get_weather(city="Paris", days=2)]', None, [WEATHER]),
    ("pythonic", "[get_weather(city='Paris', days=2), get_time(zone=\"CET\")]", None, [WEATHER, TIME]),
    ("pythonic", 'Sure. <|python_start|>[get_time(zone="CET")]<|python_end|>', "Sure.", [TIME]),
    ("qwen3_xml", QWEN_WEATHER, None, [WEATHER]),
    ("qwen3_xml", "I will check.\n" + QWEN_WEATHER + "\n" + QWEN_TIME, "I will check.", [WEATHER, TIME]),
    ("qwen3_coder", QWEN_TIME, None, [TIME]),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]', None, [WEATHER]),
    ("phi4_mini_json", 'Sure. functools[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
     '{"name": "get_time", "arguments": {"zone": "CET"}}]', "Sure.", [WEATHER, TIME]),
]
# Texts with no call in them: all content.
NO_CALLS = [
    ("hermes", "Paris is warm <b>today</b>."),
    ("llama3_json", "The set {1, 2} has two elements."),
    ("mistral", "An array [1, 2] and [TOOL no."),
    ("mistral", "[1] is a citation, [TOOL_ no."),
    ("mistral", "get_weather is a tool {of ours}."),
    ("pythonic", "The answer is [1] (see above)."),
    ("qwen3_xml", "Use <tool> tags, not <tool_call."),
    ("phi4_mini_json", "Import functools, then call it."),
]
# Broken before any call's name is whole: no call delta is ever sent.
MALFORMED_EARLY = [
    ("hermes", '<tool_call>{"name": "launch_missiles", "arguments": {}}</tool_call>'),  # not a declared tool
    ("hermes", "<tool_call>get_weather(city=Paris)</tool_call>"),
    ("llama3_json", '<|python_tag|>{"name": "launch", "parameters": {}}'),
    ("mistral", '[TOOL_CALLS]launch[ARGS]{"x": 1}'),
    ("mistral", "[TOOL_CALLS] the weather is fine"),
    ("pythonic", '[launch(x=1)]'),
    ("pythonic", "[1, 2, 3]"),
    ("qwen3_xml", "<tool_call>\n<function=launch>\n</function>\n</tool_call>"),
    ("qwen3_xml", "<tool_call>\n<call name=get_weather/>\n</tool_call>"),
    ("phi4_mini_json", 'functools[{"name": "launch", "arguments": {}}]'),
]
# Broken (or cut by max_tokens) after a call began: the whole text is content.
MALFORMED_LATE = [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>'),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city" "Paris"}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris",}}]'),
    ("pythonic", '[get_weather("Paris")]'),
    ("pythonic", '[get_weather(city=Paris)]'),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<city>Paris</city>\n</function>\n</tool_call>"),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": "Paris"}} oops]'),
]
CUT = [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "da'),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Par'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_ti'),
    ("pythonic", '[get_weather(city="Paris", da'),
    ("pythonic", '[get_weather(city="Paris")'),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=da"),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": '),
]


def parser(name: str):
    return TOOL_PARSERS[name](TOOLS)


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def streamed(name: str, pieces: list[str], finish: str = "stop") -> tuple[str | None, list[dict], str | None, int]:
    """(the content as streamed, the calls {id, name, arguments}, the finish reason, the number of
    argument deltas) of `pieces` streamed; checks each call's id and name come once, first."""
    streamer = ToolCallStreamer("auto", parser(name))
    content, calls, num_argument_deltas, finish_reason = "", [], 0, None
    for i, piece in enumerate([*pieces, ""]):
        deltas, finish_reason = streamer.feed(0, piece, finish if i == len(pieces) else None)
        for delta in deltas:
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert call["index"] == len(calls) and call["function"]["arguments"] == ""
                    calls.append({"id": call["id"], "name": call["function"]["name"], "arguments": ""})
                else:
                    assert "name" not in call["function"] and call["index"] < len(calls)
                    calls[call["index"]]["arguments"] += call["function"]["arguments"]
                    num_argument_deltas += 1
    return content, calls, finish_reason, num_argument_deltas


def splits(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def test_every_vllm_name_has_a_parser():
    assert {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml", "qwen3_coder", "phi4_mini_json"} <= set(TOOL_PARSERS)


@pytest.mark.parametrize("name, text, content, calls", WELL_FORMED)
def test_well_formed_calls_are_found_with_the_content_before_them(name, text, content, calls):
    found_content, found = parser(name).extract(text)
    assert found_content == content
    assert calls_of(found) == calls


@pytest.mark.parametrize("name, text, content, calls", WELL_FORMED)
def test_calls_streamed_char_by_char_add_up_to_the_whole_parse(name, text, content, calls):
    streamed_content, streamed_calls, finish, num_argument_deltas = streamed(name, list(text))
    whole_content, whole_calls = parser(name).extract(text)
    assert (streamed_content.strip() or None) == whole_content == content
    assert [(c["name"], c["arguments"]) for c in streamed_calls] == [(c.name, c.arguments) for c in whole_calls]
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls] == calls
    assert finish == "tool_calls"
    assert num_argument_deltas > len(calls)  # the arguments arrive in pieces, not once at the end


@settings(max_examples=25, deadline=None)
@given(case=st.sampled_from(WELL_FORMED + [(n, t, None, None) for n, t in MALFORMED_EARLY + MALFORMED_LATE + NO_CALLS]),
       cuts=st.lists(st.integers(0, 400), max_size=12))
def test_calls_streamed_in_random_pieces_add_up_to_the_whole_parse(case, cuts):
    name, text, _, _ = case
    streamed_content, streamed_calls, finish, _ = streamed(name, splits(text, cuts))
    whole_content, whole_calls = parser(name).extract(text)
    if whole_calls:
        assert (streamed_content.strip() or None) == whole_content
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == [(c.name, c.arguments) for c in whole_calls]
        assert finish == "tool_calls"
    else:  # the whole text is content, streamed as it is
        assert streamed_content == whole_content and finish == "stop"


@pytest.mark.parametrize("name, text", NO_CALLS)
def test_text_without_calls_is_all_content(name, text):
    assert parser(name).extract(text) == (text, [])
    assert streamed(name, list(text))[:3] == (text, [], "stop")


@pytest.mark.parametrize("name, text", MALFORMED_EARLY)
def test_a_call_broken_before_its_name_is_whole_is_content_and_never_a_call(name, text):
    assert parser(name).extract(text) == (text, [])
    assert streamed(name, list(text))[:3] == (text, [], "stop")


@pytest.mark.parametrize("name, text", MALFORMED_LATE)
def test_a_malformed_call_leaves_the_whole_text_as_content(name, text):
    assert parser(name).extract(text) == (text, [])
    content, _, finish, _ = streamed(name, list(text))
    assert (content, finish) == (text, "stop")  # the stream's content is the whole text too


@pytest.mark.parametrize("name, text", CUT)
def test_a_call_cut_by_max_tokens_leaves_the_whole_text_as_content(name, text):
    assert parser(name).extract(text) == (text, [])
    content, _, finish, _ = streamed(name, list(text), finish="length")
    assert (content, finish) == (text, "length")


@pytest.mark.parametrize("name, text", MALFORMED_EARLY + MALFORMED_LATE + CUT)
def test_every_prefix_of_a_broken_call_scans_without_error(name, text):
    for end in range(len(text) + 1):
        for final in (False, True):
            parser(name).scan(text[:end], final)


def test_qwen3_xml_types_values_by_the_tools_schema():
    tools = tool_functions([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"}, "tags": {"type": "array"},
        "opts": {"type": "object"}, "code": {"type": "string"}, "maybe": {"type": ["integer", "null"]}}}}}])
    params = {"n": "42", "x": "2.5", "ok": "true", "tags": '["a", "b"]', "opts": '{"deep": 1}', "code": "007",
              "maybe": "null", "free": "plain text"}
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    _, (call,) = TOOL_PARSERS["qwen3_xml"](tools).extract(f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>")
    assert json.loads(call.arguments) == {"n": 42, "x": 2.5, "ok": True, "tags": ["a", "b"], "opts": {"deep": 1},
                                          "code": "007", "maybe": None, "free": "plain text"}


def test_qwen3_xml_reads_enum_values_as_the_schema_lists_them_and_a_call_ending_at_its_function():
    tools = tool_functions([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "days": {"enum": [1, 2]}, "city": {"enum": ["Paris", "Oslo"]}}}}}])
    text = "<tool_call>\n<function=f>\n<parameter=days>2 </parameter><parameter=city>\nOslo\n</parameter></function>"
    _, (call,) = TOOL_PARSERS["qwen3_xml"](tools).extract(text)
    assert json.loads(call.arguments) == {"days": 2, "city": "Oslo"}


def test_without_declared_tools_any_name_is_a_call():
    _, calls = TOOL_PARSERS["hermes"]().extract('<tool_call>{"name": "anything", "arguments": {}}</tool_call>')
    assert [c.name for c in calls] == ["anything"]
