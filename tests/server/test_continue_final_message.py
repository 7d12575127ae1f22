"""A reply that continues the conversation's last (assistant) message: vLLM's
`continue_final_message` on the chat route, and Anthropic's prefill (a last message of the
assistant's) on `/v1/messages`. The oracle is transformers' chat template with
`continue_final_message=True`, its prompt's greedy completion on `/v1/completions`."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.server.common import MODEL

PREFILL = "The weather in Paris is"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}, {"role": "assistant", "content": PREFILL}]


@pytest.fixture(scope="module")
def chat(server_url):
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def expected(chat, tokenizer):
    """The prompt that leaves the last message open, and its greedy continuation."""
    prompt = tokenizer.apply_chat_template(MESSAGES, continue_final_message=True, tokenize=True, return_dict=False)
    assert tokenizer.decode(prompt).endswith(PREFILL)  # open: no end-of-turn after it
    completion = chat.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    return prompt, completion.choices[0].text


def test_the_chat_route_continues_the_final_message(chat, expected):
    prompt, text = expected
    reply = chat.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                         extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.choices[0].message.content == text


@pytest.mark.parametrize("body, param", [
    ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt still true
    ({"continue_final_message": True, "add_generation_prompt": False, "messages": MESSAGES[:1]}, "messages"),
])
def test_continuing_is_refused_naming_what_to_change(server_url, body, param):
    reply = httpx.post(server_url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **body},
                       timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_an_anthropic_prefill_is_continued_and_the_reply_holds_only_the_new_text(server_url, expected):
    prompt, text = expected
    claude = anthropic.Anthropic(base_url=server_url, api_key="unused", max_retries=0)
    message = claude.messages.create(model=MODEL, max_tokens=6, messages=MESSAGES, extra_body={"temperature": 0})
    assert message.usage.input_tokens == len(prompt)
    assert "".join(block.text for block in message.content if block.type == "text") == text
    counted = claude.messages.count_tokens(model=MODEL, messages=MESSAGES)
    assert counted.input_tokens == len(prompt)
    streamed = "".join(event.delta.text for event in claude.messages.create(
        model=MODEL, max_tokens=6, messages=MESSAGES, extra_body={"temperature": 0}, stream=True)
        if event.type == "content_block_delta")
    assert streamed == text


@pytest.mark.parametrize("last, why", [
    ({"role": "assistant", "content": "It is "}, "whitespace"),
    ({"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}, "tool_use"),
])
def test_a_prefill_anthropic_refuses_is_refused_here_too(server_url, last, why):
    body = {"model": MODEL, "max_tokens": 4, "messages": [MESSAGES[0], last]}
    reply = httpx.post(server_url + "/v1/messages", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["type"] == "error", reply.text
    assert why in reply.json()["error"]["message"] and "messages[1]" in reply.json()["error"]["message"]
