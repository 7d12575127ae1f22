"""Thinking blocks on `/v1/messages` from the reasoning parser (`--reasoning-parser qwen3`), with
the official `anthropic` client against a scripted tiny model (tests/scripted_model.py) whose
greedy output after the template's "assistant\\n" is `<think>plan</think>answer`, and `answer`
after a prompt that closed thinking (the template's `enable_thinking` false, which Anthropic's
`thinking: {"type": "disabled"}` sets). The thinking arrives as a `thinking` block before the
text, whole and streamed as `thinking_delta`s in a block of its own."""

from __future__ import annotations

import anthropic
import pytest

from pagedllm.cli import build_parser
from tests.scripted_model import build_scripted_model
from tests.server.common import MODEL, SERVE_FLAGS, start_server_thread

THINK, END = "<think>", "</think>"
# Qwen3's generation prompt, cut short: enable_thinking false closes thinking in the prompt.
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
USER = [{"role": "user", "content": "Is it warm in Paris?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def claude(tmp_path_factory, tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    newline, double_newline = tokenizer.encode("\n"), tokenizer.encode("\n\n")
    script = [(newline[0], THINK), (THINK, "plan"), ("plan", END), (END, "answer"), ("answer", tokenizer.eos_token),
              (double_newline[0], "answer")]
    model = build_scripted_model(tmp_path_factory.mktemp("thinker"), tokenizer_dir, script, added_tokens=[THINK, END],
                                 chat_template=TEMPLATE)
    args = build_parser().parse_args(["serve", str(model), "--port", "0", *SERVE_FLAGS, "--reasoning-parser", "qwen3"])
    server, thread, url = start_server_thread(args)
    yield anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    server.should_exit = True
    thread.join(30)


def _blocks(message) -> list[tuple[str, str]]:
    return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content]


def test_the_thinking_is_a_thinking_block_before_the_text(claude):
    message = claude.messages.create(model=MODEL, max_tokens=20, messages=USER, extra_body=GREEDY)
    assert _blocks(message) == [("thinking", "plan"), ("text", "answer")]
    assert message.stop_reason == "end_turn"


def test_streamed_thinking_is_a_block_of_thinking_deltas_then_the_text(claude):
    with claude.messages.create(model=MODEL, max_tokens=20, messages=USER, extra_body=GREEDY, stream=True) as stream:
        events = list(stream)
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == "plan"
    assert "".join(d.text for d in deltas if d.type == "text_delta") == "answer"
    assert [e.index for e in events if e.type == "content_block_stop"] == [0, 1]
    with claude.messages.stream(model=MODEL, max_tokens=20, messages=USER, extra_body=GREEDY) as stream:
        assert _blocks(stream.get_final_message()) == [("thinking", "plan"), ("text", "answer")]


def test_thinking_disabled_closes_it_in_the_prompt(claude):
    message = claude.messages.create(model=MODEL, max_tokens=20, messages=USER,
                                     extra_body={**GREEDY, "thinking": {"type": "disabled"}})
    assert _blocks(message) == [("text", "answer")]
