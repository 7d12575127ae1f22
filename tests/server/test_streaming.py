"""Streamed completions and chats give exactly the non-streamed text, finish reasons and usage (also with stop, n, echo, beam search)."""

from __future__ import annotations

import httpx

from tests.server.common import GREEDY, MAX_MODEL_LEN, MODEL, streamed_completion


def test_completion_streamed_text_equals_non_streamed_and_usage_is_right(client, tokenizer):
    prompt = "The capital of France is"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY)
    texts, reasons, usage = streamed_completion(client, model=MODEL, prompt=prompt, max_tokens=24, **GREEDY)
    assert texts == {0: full.choices[0].text} and full.choices[0].text
    assert reasons == {0: "length"} == {0: full.choices[0].finish_reason}
    num_prompt = len(tokenizer.encode(prompt))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (num_prompt, 24, num_prompt + 24)
    assert usage["prompt_tokens"] == num_prompt and usage["completion_tokens"] == 24
    # The same prompt again is served from the prefix cache (its full blocks, at least).
    client.completions.create(model=MODEL, prompt=[7] * 40, max_tokens=2, **GREEDY)
    again = client.completions.create(model=MODEL, prompt=[7] * 40, max_tokens=2, **GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens == 32


def test_chat_streamed_equals_non_streamed_and_counts_template_tokens(client, server_url, tokenizer):
    messages = [{"role": "user", "content": "Tell me a joke about cats."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, **GREEDY)
    deltas, roles, usage = [], [], None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, stream=True, stream_options={"include_usage": True}, **GREEDY
    ):
        for choice in chunk.choices:
            roles += [choice.delta.role] if choice.delta.role else []
            deltas.append(choice.delta.content or "")
        usage = chunk.usage or usage
    assert "".join(deltas) == full.choices[0].message.content and full.choices[0].message.role == "assistant"
    assert roles == ["assistant"]
    template = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    num_prompt = len(tokenizer.encode(template, add_special_tokens=False))
    assert full.usage.prompt_tokens == usage.prompt_tokens == num_prompt
    assert full.usage.completion_tokens == usage.completion_tokens == 20
    counted = httpx.post(server_url + "/tokenize", json={"messages": messages}).json()
    assert counted["count"] == num_prompt and counted["max_model_len"] == MAX_MODEL_LEN


def test_stop_string_cuts_streamed_and_non_streamed_text_alike(client):
    prompt = [11, 22, 33, 44, 55]
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, **GREEDY).choices[0].text
    stop = text[10:13]  # usually spans a token boundary, so a prefix of it arrives first
    expected = text[: text.find(stop)]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, stop=[stop], **GREEDY).choices[0]
    texts, reasons, _ = streamed_completion(client, model=MODEL, prompt=prompt, max_tokens=30, stop=[stop], **GREEDY)
    assert (cut.text, cut.finish_reason, cut.model_dump()["stop_reason"]) == (expected, "stop", stop)
    assert texts == {0: expected} and reasons == {0: "stop"}


def test_n_returns_n_choices_streamed_or_not(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, n=3, temperature=1.0, seed=1,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    assert sorted(c.index for c in full.choices) == [0, 1, 2]
    assert len({c.text for c in full.choices}) > 1  # sampled, not three copies
    texts, reasons, usage = streamed_completion(client, **kwargs)
    assert texts == {c.index: c.text for c in full.choices}  # the request's own seed: same samples
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert full.usage.completion_tokens == usage["completion_tokens"] == 3 * 8


def test_echo_prepends_the_prompt_streamed_or_not(client):
    kwargs = dict(model=MODEL, prompt="Echo this:", max_tokens=4, echo=True, **GREEDY)
    full = client.completions.create(**kwargs).choices[0].text
    plain = client.completions.create(**{**kwargs, "echo": False}).choices[0].text
    texts, _, _ = streamed_completion(client, **kwargs)
    assert full == "Echo this:" + plain and texts == {0: full}


def test_beam_search_returns_the_best_beams_streamed_or_not(client):
    kwargs = dict(model=MODEL, prompt="The best way to learn is", max_tokens=8, n=2,
                  extra_body={"use_beam_search": True, "best_of": 3, "ignore_eos": True})
    full = client.completions.create(**kwargs)
    texts, _, _ = streamed_completion(client, **kwargs)
    assert len(full.choices) == 2 and texts == {c.index: c.text for c in full.choices}
