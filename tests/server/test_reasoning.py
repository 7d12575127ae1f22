"""Reasoning parsers end to end (`--reasoning-parser`), with the official `openai` client against a
scripted tiny model (tests/scripted_model.py) whose greedy output is known text: after the chat
template's "assistant\\n" it writes `<think>plan</think>answer`, after a template that closed
thinking (`enable_thinking: false`) `answer`, and after a bare "assistant" a Hermes tool call and
then `</think>answer`. The thinking reaches `reasoning` and `reasoning_content`, the rest
`content`, streamed and not; usage counts the reasoning tokens; a grammar (response_format, a
forced tool call) constrains only what follows `</think>`; tool calls are read from the answer."""

from __future__ import annotations

import json
from collections import defaultdict

import jsonschema
import openai
import pytest

from pagedllm.cli import build_parser
from tests.scripted_model import build_scripted_model
from tests.server.common import MODEL, SERVE_FLAGS, start_server_thread

THINK, END = "<think>", "</think>"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# Qwen3's generation prompt, cut to what the tests vary: `assistant_suffix` ends the prompt
# ("\n" by default), and enable_thinking false closes thinking in it.
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ assistant_suffix if assistant_suffix is defined else '\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Is it warm in Paris?"}]
ANSWER_SCHEMA = {"type": "string", "enum": ["yes", "no"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
BARE_PROMPT = {"chat_template_kwargs": {"assistant_suffix": ""}}  # the prompt ends "assistant"


@pytest.fixture(scope="module")
def thinker(tmp_path_factory, tokenizer_dir):
    """The scripted model: its tokenizer has <think>, </think> and CALL as tokens of their own."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    newline, double_newline = tokenizer.encode("\n"), tokenizer.encode("\n\n")
    bare_end = tokenizer.encode("<|im_start|>assistant", add_special_tokens=False)[-1]
    assert len(newline) == len(double_newline) == 1
    script = [
        (newline[0], THINK), (THINK, "plan"), ("plan", END), (END, "answer"), ("answer", tokenizer.eos_token),
        (double_newline[0], "answer"),  # after "</think>\n\n": answer at once
        (bare_end, CALL), (CALL, END),
    ]
    path = tmp_path_factory.mktemp("thinker")
    return build_scripted_model(path, tokenizer_dir, script, added_tokens=[THINK, END, CALL], chat_template=TEMPLATE)


def serve(model, parser: str):
    args = build_parser().parse_args(["serve", str(model), "--port", "0", *SERVE_FLAGS, "--max-model-len", "1024",
                                      "--reasoning-parser", parser])
    server, thread, url = start_server_thread(args)
    return server, thread, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def qwen3(thinker):
    server, thread, client = serve(thinker, "qwen3")
    yield client
    server.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def deepseek(thinker):
    server, thread, client = serve(thinker, "deepseek_r1")
    yield client
    server.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def token_count(thinker):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(thinker))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def chat(client, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 20, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)


def reasoning_of(message_or_delta) -> str | None:
    """`reasoning`, after checking that the older name `reasoning_content` says the same."""
    reasoning = getattr(message_or_delta, "reasoning", None)
    assert getattr(message_or_delta, "reasoning_content", None) == reasoning
    return reasoning


def streamed(client, **kwargs) -> tuple[dict, dict, dict, object]:
    """Per choice: the reasoning and the content (None if no delta had any), the kinds of its
    deltas in order, and its tool-call deltas; then the usage."""
    reasoning: dict = defaultdict(lambda: None)
    content: dict = defaultdict(lambda: None)
    kinds: dict = defaultdict(list)
    usage = None
    kwargs = {"temperature": 0, "max_tokens": 20, **kwargs}
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                stream_options={"include_usage": True}, **kwargs):
        for choice in chunk.choices:
            delta, index = choice.delta, choice.index
            if piece := reasoning_of(delta):
                reasoning[index] = (reasoning[index] or "") + piece
                kinds[index].append("reasoning")
            if delta.content:
                content[index] = (content[index] or "") + delta.content
                kinds[index].append("content")
            if delta.tool_calls:
                kinds[index].append("tool_calls")
        usage = chunk.usage or usage
    return reasoning, content, kinds, usage


def test_the_thinking_goes_to_reasoning_and_the_answer_to_content(qwen3, token_count):
    reply = chat(qwen3)
    message = reply.choices[0].message
    assert (reasoning_of(message), message.content) == ("plan", "answer")
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens_details.reasoning_tokens == token_count(THINK + "plan" + END)
    assert reply.usage.completion_tokens == token_count(THINK + "plan" + END + "answer") + 1  # and the EOS


def test_the_stream_sends_the_thinking_then_the_answer_as_the_whole_reply_has_them(qwen3, token_count):
    reasoning, content, kinds, usage = streamed(qwen3)
    assert (reasoning[0], content[0]) == ("plan", "answer")
    assert kinds[0] == sorted(kinds[0], key=["reasoning", "content"].index)  # no answer before the thinking ends
    assert usage.completion_tokens_details.reasoning_tokens == token_count(THINK + "plan" + END)


def test_each_of_n_streamed_choices_is_split_on_its_own(qwen3):
    reasoning, content, _, usage = streamed(qwen3, n=3, temperature=1.0, seed=7)
    assert [(reasoning[i], content[i]) for i in range(3)] == [("plan", "answer")] * 3
    full = chat(qwen3, n=3, temperature=1.0, seed=7)
    assert [(reasoning_of(c.message), c.message.content) for c in full.choices] == [("plan", "answer")] * 3
    assert full.usage.completion_tokens_details.reasoning_tokens == usage.completion_tokens_details.reasoning_tokens


def test_enable_thinking_false_makes_the_whole_output_the_answer(qwen3):
    reply = chat(qwen3, extra_body=NO_THINKING)
    assert (reasoning_of(reply.choices[0].message), reply.choices[0].message.content) == (None, "answer")
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    reasoning, content, _, _ = streamed(qwen3, extra_body=NO_THINKING)
    assert (reasoning[0], content[0]) == (None, "answer")


def test_an_output_cut_by_max_tokens_while_thinking_is_all_reasoning(qwen3, token_count):
    reply = chat(qwen3, max_tokens=2)
    choice = reply.choices[0]
    assert (reasoning_of(choice.message), choice.message.content, choice.finish_reason) == ("plan", None, "length")
    assert reply.usage.completion_tokens_details.reasoning_tokens == reply.usage.completion_tokens == 2
    reasoning, content, _, _ = streamed(qwen3, max_tokens=2)
    assert (reasoning[0], content[0]) == ("plan", None)


def test_qwen3_reads_an_output_that_opens_no_thinking_as_content(qwen3):
    reply = chat(qwen3, extra_body=BARE_PROMPT)  # no tools: the call's text is just text
    assert (reasoning_of(reply.choices[0].message), reply.choices[0].message.content) == (None, CALL + END + "answer")
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0


def test_deepseek_r1_reads_the_output_as_thinking_from_its_start(deepseek, token_count):
    reply = chat(deepseek, extra_body=BARE_PROMPT)
    assert (reasoning_of(reply.choices[0].message), reply.choices[0].message.content) == (CALL, "answer")
    assert reply.usage.completion_tokens_details.reasoning_tokens == token_count(CALL + END)
    # A model that writes the start tag the template opened: the tag is not reasoning.
    assert (reasoning_of(chat(deepseek).choices[0].message), chat(deepseek).choices[0].message.content) == ("plan", "answer")


def test_a_tool_call_in_the_thinking_is_no_call_and_one_in_the_answer_is(qwen3, deepseek):
    thought = chat(deepseek, tools=[WEATHER], extra_body=BARE_PROMPT).choices[0]
    assert (reasoning_of(thought.message), thought.message.content) == (CALL, "answer")
    assert not thought.message.tool_calls and thought.finish_reason == "stop"
    reasoning, content, kinds, _ = streamed(deepseek, tools=[WEATHER], extra_body=BARE_PROMPT)
    assert (reasoning[0], content[0]) == (CALL, "answer") and "tool_calls" not in kinds[0]

    said = chat(qwen3, tools=[WEATHER], extra_body=BARE_PROMPT).choices[0]  # qwen3: no <think>, so the answer
    assert said.finish_reason == "tool_calls" and reasoning_of(said.message) is None
    (call,) = said.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})


def test_a_json_schema_constrains_only_the_answer_after_the_thinking(qwen3):
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    reply = chat(qwen3, response_format=response_format)
    message = reply.choices[0].message
    assert reasoning_of(message) == "plan"  # free text: the scripted thinking, which the schema would not allow
    jsonschema.validate(json.loads(message.content), ANSWER_SCHEMA)
    reasoning, content, _, _ = streamed(qwen3, response_format=response_format)
    assert (reasoning[0], content[0]) == ("plan", message.content)
    # With thinking closed in the prompt, the grammar holds from the first token.
    closed = chat(qwen3, response_format=response_format, extra_body=NO_THINKING).choices[0].message
    assert reasoning_of(closed) is None
    jsonschema.validate(json.loads(closed.content), ANSWER_SCHEMA)


def test_a_first_token_that_does_not_open_thinking_is_the_grammars(qwen3, thinker):
    from transformers import AutoTokenizer

    think = AutoTokenizer.from_pretrained(str(thinker)).convert_tokens_to_ids(THINK)
    reply = chat(qwen3, logit_bias={str(think): -100},
                 extra_body={"structured_outputs": {"json": ANSWER_SCHEMA}})
    message = reply.choices[0].message
    assert reasoning_of(message) is None
    jsonschema.validate(json.loads(message.content), ANSWER_SCHEMA)


def test_a_forced_tool_call_comes_after_the_thinking(qwen3):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = chat(qwen3, tools=[WEATHER], tool_choice=choice).choices[0]
    assert (reasoning_of(reply.message), reply.message.content, reply.finish_reason) == ("plan", None, "tool_calls")
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    reasoning, _, kinds, _ = streamed(qwen3, tools=[WEATHER], tool_choice=choice)
    assert reasoning[0] == "plan" and kinds[0][0] == "reasoning" and kinds[0][-1] == "tool_calls"
    assert "content" not in kinds[0]


def test_include_reasoning_false_leaves_the_thinking_out(qwen3):
    message = chat(qwen3, extra_body={"include_reasoning": False}).choices[0].message
    assert (reasoning_of(message), message.content) == (None, "answer")
    reasoning, content, _, _ = streamed(qwen3, extra_body={"include_reasoning": False})
    assert (reasoning[0], content[0]) == (None, "answer")
