"""Evaluation-harness support: `echo` with `logprobs` returns the prompt's logprobs (the first
token's None) equal to a transformers forward on the same tokens and weights, streamed or not,
with max_tokens 0 or 1 as lm-evaluation-harness asks; `prompt_logprobs` (vLLM's field) on
completions and chat."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from tests.helpers import load_hf
from tests.server.common import MODEL

PROMPT = [1, 504, 3458, 314, 253, 1345, 28, 284, 357, 1637, 2951, 30]  # token ids (BOS first)
CONTINUATION = [669, 3458, 314]


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama):
    """Log-softmax of transformers' logits over a sequence, float32: [len(tokens), vocab]."""
    hf = load_hf(tiny_llama)

    def forward(tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)

    return forward


def post(server_url: str, route: str, body: dict) -> dict:
    response = httpx.post(server_url + route, json={"model": MODEL, "temperature": 0, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def stream(server_url: str, body: dict) -> list[dict]:
    body = {"model": MODEL, "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", server_url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def assert_matches_transformers(logprobs: dict, tokens: list[int], ref: torch.Tensor) -> None:
    """Each position after the first holds the logprob of its token given the ones before, and
    its top list starts with the most likely token's logprob."""
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert len(logprobs["token_logprobs"]) == len(tokens)
    for pos in range(1, len(tokens)):
        expected = ref[pos - 1, tokens[pos]].item()
        assert math.isclose(logprobs["token_logprobs"][pos], expected, abs_tol=1e-4), pos
        assert math.isclose(max(logprobs["top_logprobs"][pos].values()), ref[pos - 1].max().item(), abs_tol=1e-4)


def test_echo_with_logprobs_gives_the_prompts_logprobs_as_transformers_computes_them(server_url, hf_logprobs, tokenizer):
    body = post(server_url, "/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3,
                                                "ignore_eos": True})
    choice = body["choices"][0]
    generated = tokenizer.encode(choice["text"][len(tokenizer.decode(PROMPT)):], add_special_tokens=False)
    tokens = PROMPT + generated
    assert len(generated) == 3 and choice["text"].startswith(tokenizer.decode(PROMPT))
    assert_matches_transformers(choice["logprobs"], tokens, hf_logprobs(tokens))
    assert choice["logprobs"]["tokens"][:2] == [tokenizer.decode(PROMPT[:1]), tokenizer.decode(PROMPT[1:2])]
    offsets = choice["logprobs"]["text_offset"]
    assert offsets[0] == 0 and offsets[1] == len(tokenizer.decode(PROMPT[:1]))
    assert body["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_an_lm_eval_loglikelihood_request_scores_each_continuation(server_url, hf_logprobs, max_tokens):
    """lm-evaluation-harness's local-completions request: a batch of token-id prompts (context
    and continuation), echo, logprobs=1; it sums token_logprobs over the continuation."""
    greedy_continuation = []
    for _ in range(3):  # what the model itself would say next: the harness's is_greedy holds for it
        greedy_continuation.append(hf_logprobs(PROMPT + greedy_continuation)[-1].argmax().item())
    contexts = [PROMPT, PROMPT[:6], PROMPT]
    prompts = [PROMPT + CONTINUATION, PROMPT[:6] + CONTINUATION, PROMPT + greedy_continuation]
    greedy_seen = []
    body = post(server_url, "/v1/completions", {"prompt": prompts, "echo": True, "logprobs": 1,
                                                "max_tokens": max_tokens, "seed": 1234})
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for context, prompt, choice in zip(contexts, prompts, body["choices"]):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt) + max_tokens
        ref = hf_logprobs(prompt)
        score = sum(logprobs["token_logprobs"][len(context) : len(prompt)])
        expected = sum(ref[pos - 1, prompt[pos]].item() for pos in range(len(context), len(prompt)))
        assert math.isclose(score, expected, abs_tol=1e-4)
        # The harness's greedy check: is each continuation token's logprob the top one's?
        greedy = all(ref[pos - 1].argmax().item() == prompt[pos] for pos in range(len(context), len(prompt)))
        tops = logprobs["top_logprobs"][len(context) : len(prompt)]
        chosen = logprobs["token_logprobs"][len(context) : len(prompt)]
        assert greedy == all(lp == max(top.values()) for lp, top in zip(chosen, tops))
        greedy_seen.append(greedy)
    assert greedy_seen == [False, False, True]
    if max_tokens == 0:  # the prompt alone: nothing generated, nothing counted
        assert all(c["finish_reason"] == "length" for c in body["choices"])
        assert body["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_streamed_echo_logprobs_equal_the_non_streamed_ones(server_url, max_tokens):
    request = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": max_tokens, "ignore_eos": True}
    full = post(server_url, "/v1/completions", request)["choices"][0]
    chunks = stream(server_url, request)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    joined = {key: [v for c in chunks for v in c["choices"][0]["logprobs"][key]] for key in full["logprobs"]}
    assert text == full["text"] and joined == full["logprobs"]
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None  # the prompt comes first
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_prompt_logprobs_field_on_completions_and_chat(server_url, hf_logprobs, tokenizer):
    body = post(server_url, "/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 1})
    entries = body["choices"][0]["prompt_logprobs"]
    ref = hf_logprobs(PROMPT)
    assert entries[0] is None and len(entries) == len(PROMPT)
    for pos in range(1, len(PROMPT)):
        chosen = entries[pos][str(PROMPT[pos])]
        assert math.isclose(chosen["logprob"], ref[pos - 1, PROMPT[pos]].item(), abs_tol=1e-4)
        assert chosen["rank"] == int((ref[pos - 1] > ref[pos - 1, PROMPT[pos]]).sum()) + 1
        assert chosen["decoded_token"] == tokenizer.decode([PROMPT[pos]])
        top = {int(t) for t, e in entries[pos].items() if e["rank"] <= 2}
        assert top == set(ref[pos - 1].topk(2).indices.tolist())

    messages = [{"role": "user", "content": "Hello there"}]
    chat = post(server_url, "/v1/chat/completions", {"messages": messages, "prompt_logprobs": 0, "max_tokens": 1})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    ref = hf_logprobs(prompt_ids)
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(prompt_ids)
    last = chat["prompt_logprobs"][-1][str(prompt_ids[-1])]["logprob"]
    assert math.isclose(last, ref[-2, prompt_ids[-1]].item(), abs_tol=1e-4)


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1, "stream": True}),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": "1"}),
])
def test_prompt_logprobs_that_cannot_be_served_get_a_400_naming_the_field(server_url, route, body):
    response = httpx.post(server_url + route, json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_logprobs"


def test_max_tokens_zero_without_echo_is_refused(server_url):
    response = httpx.post(server_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 0}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
