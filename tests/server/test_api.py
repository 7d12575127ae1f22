"""The plain endpoints answer in OpenAI's shapes: models, health, version, batched prompts, logprobs and tokenize."""

from __future__ import annotations

import httpx

from pagedllm import __version__
from tests.server.common import GREEDY, MAX_MODEL_LEN, MODEL


def test_models_health_and_version(client, server_url):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.model_dump()["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(server_url + "/health").status_code == 200
    assert httpx.get(server_url + "/version").json() == {"version": __version__}


def test_batch_of_prompts_numbers_choices_prompt_by_prompt(client, tokenizer):
    prompts = ["Hello there", "The weather today"]
    full = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, n=2, temperature=1.0, seed=3,
                                     extra_body={"ignore_eos": True})
    assert sorted(c.index for c in full.choices) == [0, 1, 2, 3]
    assert full.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert full.usage.completion_tokens == 4 * 5


def test_logprobs_in_openai_shapes(client):
    completion = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, logprobs=2, **GREEDY).choices[0]
    lp = completion.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) >= 2 and top[token] == logprob
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY
    ).choices[0]
    content = chat.logprobs.content
    assert len(content) == 5
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert len(entry.top_logprobs) == 3
        # Greedy decoding picks the most likely token.
        assert (entry.token, entry.logprob) == (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())


def test_tokenize_and_detokenize_round_trip(server_url, tokenizer):
    tokens = httpx.post(server_url + "/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()["tokens"]
    assert tokens == tokenizer.encode("Hello world")
    assert httpx.post(server_url + "/detokenize", json={"tokens": tokens}).json() == {"prompt": "Hello world", "content": "Hello world"}
