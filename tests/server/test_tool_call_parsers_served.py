"""`--tool-call-parser NAME` end to end, with the official `openai` and `anthropic` clients against
a scripted tiny model (tests/scripted_model.py) that writes, after the generation prompt's
per-format trigger (the user's message, which the template puts last), a known call in that format, a few tokens at a time: the calls reach
`tool_calls` whole and streamed (the arguments in more than one delta), and the Anthropic route's
`tool_use` blocks (`input_json_delta`s); a call cut by max_tokens is content."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from pagedllm.cli import build_parser
from tests.scripted_model import build_scripted_model
from tests.server.common import MODEL, SERVE_FLAGS, start_server_thread

# What the model writes after each format's trigger, token by token (each piece one token,
# unique across formats: the model is a bigram table). Hand-written; each is get_weather(Paris, 2).
SCRIPTS = {
    "hermes": ["Let me check. ", '<tool_call>\n{"name": "get_weather", "arguments": {"city": ', '"Paris", "days"',
               ': 2}}\n</tool_call>'],
    "llama3_json": ['<|python_tag|>{"name": "get_weather", "parameters": {"city": ', '"Paris"', ', "days": 2}}'],
    "mistral": ['[TOOL_CALLS]get_weather[ARGS]{"city": ', '"Paris", "days": ', "2}"],
    "pythonic": ["[get_weather(city=", '"Paris", days', "=2)]"],
    "qwen3_xml": ["<tool_call>\n<function=get_weather>\n<parameter=city>\n", "Paris\n</parameter>\n<parameter=days>\n",
                  "2\n</parameter>\n</function>\n</tool_call>"],
    "phi4_mini_json": ['functools[{"name": "get_weather", "arguments": {"city": ', '"Paris", "days": 2', "}}]"],
}
# A model that opens a call and strays: an undeclared tool with arguments of its own.
STRAYS = {
    "hermes": ['<tool_call>\n{"name": ', '"launch_missiles", "arguments": {"target": "moon"}}\n</tool_call>'],
    "llama3_json": ['<|python_tag|>{"name": ', '"launch_missiles", "parameters": {"target": "moon"}}'],
    "mistral": ["[TOOL_CALLS]get_", 'weather[ARGS]{"target": "moon"}'],
    "pythonic": ["[", 'launch_missiles(target="moon")]'],
    "qwen3_xml": ["<tool_call>\n<function=", "launch_missiles>\n<parameter=target>\nmoon\n</parameter>\n</function>\n</tool_call>"],
    "phi4_mini_json": ['functools[{"name": ', '"launch_missiles", "arguments": {"target": "moon"}}]'],
}
# The formats whose "auto" calls a grammar keeps well-formed: every one (the scripts write calls
# as the grammars do, compact JSON).
CONSTRAINED = set(SCRIPTS)
STRICT_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2]}},
    "required": ["city", "days"], "additionalProperties": False}}}
CONTENT = {"hermes": "Let me check."}  # the content before the call, where the script writes some
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
ARGUMENTS = {"city": "Paris", "days": 2}
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{{ messages[-1]['content'] }}{% endif %}"
)


def messages(name: str) -> list[dict]:
    """A user message naming the format: the template ends the prompt with it, the trigger."""
    return [{"role": "user", "content": trigger(name)}]


def trigger(name: str) -> str:
    return f"<<{name}>>"


@pytest.fixture(scope="module")
def caller(tmp_path_factory, tokenizer_dir):
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(str(tokenizer_dir)).eos_token
    scripts = {**SCRIPTS, **{f"stray_{name}": steps for name, steps in STRAYS.items()}}
    pieces = [p for steps in scripts.values() for p in steps]
    assert len(set(pieces)) == len(pieces)
    script = []
    for name, steps in scripts.items():
        chain = [trigger(name), *steps, eos]
        script += list(zip(chain, chain[1:]))
    path = tmp_path_factory.mktemp("caller")
    return build_scripted_model(path, tokenizer_dir, script, added_tokens=[*map(trigger, scripts), *pieces],
                                chat_template=TEMPLATE)


@pytest.fixture(scope="module", params=list(SCRIPTS))
def served(request, caller):
    """(the format's name, an openai client, the server's URL) for a server with --tool-call-parser NAME."""
    name = request.param
    args = build_parser().parse_args(["serve", str(caller), "--port", "0", *SERVE_FLAGS, "--max-model-len", "1024",
                                      "--enable-auto-tool-choice", "--tool-call-parser", name])
    server, thread, url = start_server_thread(args)
    yield name, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), url
    server.should_exit = True
    thread.join(30)


def chat(client, name: str, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 40, "tools": [WEATHER], **kwargs}
    return client.chat.completions.create(model=MODEL, messages=messages(name), **kwargs)


def test_the_formats_call_reaches_tool_calls(served):
    name, client, _ = served
    choice = chat(client, name).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == CONTENT.get(name)
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ARGUMENTS)
    assert call.id and call.type == "function"


def test_the_streamed_call_sends_its_name_once_and_its_arguments_as_they_grow(served):
    name, client, _ = served
    content, names, ids, arguments, finish = "", [], set(), [], None
    for chunk in chat(client, name, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                assert call.index == 0
                if call.id:
                    ids.add(call.id)
                if call.function.name:
                    names.append(call.function.name)
                if call.function.arguments:
                    arguments.append(call.function.arguments)
            finish = choice.finish_reason or finish
    whole = chat(client, name).choices[0].message.tool_calls[0].function.arguments
    assert names == ["get_weather"] and len(ids) == 1
    assert len(arguments) > 1  # in pieces as the model writes them, not once at the end
    assert "".join(arguments) == whole and json.loads(whole) == ARGUMENTS
    assert (content.strip() or None, finish) == (CONTENT.get(name), "tool_calls")


def test_a_call_cut_by_max_tokens_is_content(served):
    name, client, _ = served
    cut = len(SCRIPTS[name]) - 1  # the call's last piece is never written
    written = "".join(SCRIPTS[name][:cut])
    choice = chat(client, name, max_tokens=cut).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (written, None, "length")
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, name, max_tokens=cut, stream=True) if c.choices)
    assert streamed == written


def test_without_tools_the_call_is_plain_text(served):
    name, client, _ = served
    choice = chat(client, name, tools=None).choices[0]
    assert (choice.message.content, choice.message.tool_calls) == ("".join(SCRIPTS[name]), None)


def test_the_anthropic_route_gives_the_call_as_a_tool_use_block(served):
    name, _, url = served
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    kwargs = {"model": MODEL, "max_tokens": 40, "messages": messages(name), "extra_body": {"temperature": 0},
              "tools": [{"name": "get_weather", "description": "the weather", "input_schema": WEATHER["function"]["parameters"]}]}
    message = client.messages.create(**kwargs)
    (tool_use,) = [b for b in message.content if b.type == "tool_use"]
    assert (tool_use.name, tool_use.input, message.stop_reason) == ("get_weather", ARGUMENTS, "tool_use")
    partial_json, starts = [], []
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "content_block_start":
                starts.append(event.content_block.type)
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial_json.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert starts == (["text"] if name in CONTENT else []) + ["tool_use"]
    assert len(partial_json) > 1 and json.loads("".join(partial_json)) == ARGUMENTS
    assert [b.input for b in final.content if b.type == "tool_use"] == [ARGUMENTS]


def test_a_call_that_strays_is_never_malformed(served):
    """A constrained format's grammar masks the stray into a call of a declared tool whose
    arguments fit its schema; in the other formats the stray call stays content."""
    name, client, _ = served
    kwargs = {"tools": [STRICT_WEATHER], "max_tokens": 60}
    choice = client.chat.completions.create(model=MODEL, messages=messages(f"stray_{name}"), temperature=0, **kwargs).choices[0]
    if name not in CONSTRAINED:
        assert (choice.message.content, choice.message.tool_calls) == ("".join(STRAYS[name]), None)
        return
    (call, *_) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), STRICT_WEATHER["function"]["parameters"])
    streamed: dict[int, list] = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=messages(f"stray_{name}"), temperature=0,
                                                stream=True, **kwargs):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = streamed.setdefault(delta.index, [delta.function.name, ""])
            entry[1] += delta.function.arguments or ""
    assert streamed[0] == [call.function.name, call.function.arguments]
