"""Reasoning items on `/v1/responses` from the reasoning parser (`--reasoning-parser qwen3`), with
the official `openai` client against a scripted tiny model (tests/scripted_model.py) whose
greedy output after the template's "assistant\\n" is `<think>plan</think>answer`. The thinking
arrives as a `reasoning` item before the message, whole and streamed as
`response.reasoning_text.delta`s in an item of its own; usage counts the reasoning tokens as
the chat route does."""

from __future__ import annotations

import openai
import pytest

from pagedllm.cli import build_parser
from tests.scripted_model import build_scripted_model
from tests.server.common import MODEL, SERVE_FLAGS, start_server_thread

THINK, END = "<think>", "</think>"
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTION = "Is it warm in Paris?"


@pytest.fixture(scope="module")
def client(tmp_path_factory, tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    newline = tokenizer.encode("\n")
    script = [(newline[0], THINK), (THINK, "plan"), ("plan", END), (END, "answer"), ("answer", tokenizer.eos_token)]
    model = build_scripted_model(tmp_path_factory.mktemp("thinker"), tokenizer_dir, script, added_tokens=[THINK, END],
                                 chat_template=TEMPLATE)
    args = build_parser().parse_args(["serve", str(model), "--port", "0", *SERVE_FLAGS, "--reasoning-parser", "qwen3"])
    server, thread, url = start_server_thread(args)
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    server.should_exit = True
    thread.join(30)


def test_the_thinking_is_a_reasoning_item_before_the_message(client):
    response = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=20)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0]
    assert reasoning.id.startswith("rs_") and [c.text for c in reasoning.content] == ["plan"]
    assert response.output_text == "answer" and response.status == "completed"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          temperature=0, max_tokens=20)
    assert response.usage.output_tokens_details.reasoning_tokens == chat.usage.completion_tokens_details.reasoning_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens


def test_streamed_thinking_is_a_reasoning_item_of_deltas_then_the_message(client):
    events = list(client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=20, stream=True))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thinking, text) == ("plan", "answer")
    kinds = [e.type for e in events]
    # The reasoning item closes before the message opens.
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1]
    assert final.type == "response.completed"
    assert [item.type for item in final.response.output] == ["reasoning", "message"]
    assert final.response.output[0].content[0].text == "plan"
