"""`POST /v1/embeddings` with the official `openai` client and vLLM's `POST /pooling`: vectors as
transformers pools the same weights' final hidden states (the server's default: the last token,
L2-normalized), float and base64 alike, inputs in order, usage, and errors as 400s naming the
field."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.helpers import load_hf
from tests.server.common import MAX_MODEL_LEN, MODEL, stats, wait_until

ATOL = 1e-4


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return load_hf(tiny_llama)


def last_token_embedding(hf_model, ids: list[int], dimensions: int | None = None) -> np.ndarray:
    with torch.inference_mode():
        vector = hf_model.model(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(vector[:dimensions], dim=0).numpy()


def test_the_openai_client_gets_transformers_vectors_in_float_and_base64_alike(client, hf, tokenizer):
    texts = ["The quick brown fox jumps over the lazy dog.", "hello"]
    as_float = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    as_base64 = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64 and decodes it
    assert as_float.object == "list" and as_float.model == MODEL
    for i, text in enumerate(texts):
        ours = np.array(as_float.data[i].embedding, dtype=np.float32)
        assert as_float.data[i].index == i and as_float.data[i].object == "embedding"
        np.testing.assert_allclose(ours, last_token_embedding(hf, tokenizer.encode(text)), atol=ATOL)
        assert np.array_equal(np.array(as_base64.data[i].embedding, dtype=np.float32), ours)
    num_tokens = sum(len(tokenizer.encode(t)) for t in texts)
    assert (as_float.usage.prompt_tokens, as_float.usage.total_tokens) == (num_tokens, num_tokens)


def test_base64_is_little_endian_float32(server_url):
    body = {"model": MODEL, "input": [5, 6, 7]}
    floats = httpx.post(server_url + "/v1/embeddings", json=body).json()["data"][0]["embedding"]
    encoded = httpx.post(server_url + "/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == np.array(floats, dtype=np.float32).tolist()


def test_token_id_lists_keep_their_order_and_index(client, hf):
    prompts = [[100 + i] * n for i, n in enumerate([30, 1, 12, 200, 7])]
    response = client.embeddings.create(model=MODEL, input=prompts, encoding_format="float")
    assert [d.index for d in response.data] == list(range(len(prompts)))
    for prompt, item in zip(prompts, response.data):
        np.testing.assert_allclose(np.array(item.embedding), last_token_embedding(hf, prompt), atol=ATOL)
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, prompts))


def test_dimensions_cut_then_normalize(client, hf):
    response = client.embeddings.create(model=MODEL, input=[[9, 8, 7, 6]], dimensions=8, encoding_format="float")
    np.testing.assert_allclose(np.array(response.data[0].embedding), last_token_embedding(hf, [9, 8, 7, 6], 8), atol=ATOL)


def test_vllm_extra_fields_truncate_and_normalize(server_url, hf):
    long = list(range(1000, 1000 + MAX_MODEL_LEN + 40))
    body = {"model": MODEL, "input": [long], "truncate_prompt_tokens": 20, "encoding_format": "float"}
    response = httpx.post(server_url + "/v1/embeddings", json=body).json()
    assert response["usage"]["prompt_tokens"] == 20
    np.testing.assert_allclose(response["data"][0]["embedding"], last_token_embedding(hf, long[-20:]), atol=ATOL)
    raw = httpx.post(server_url + "/v1/embeddings", json={"input": [[4, 5]], "normalize": False}).json()
    with torch.inference_mode():
        expected = hf.model(torch.tensor([[4, 5]])).last_hidden_state[0, -1].numpy()
    np.testing.assert_allclose(raw["data"][0]["embedding"], expected, atol=ATOL)


def test_chat_messages_embed_their_templated_prompt(server_url, hf, tokenizer):
    messages = [{"role": "user", "content": "Embed this conversation."}]
    response = httpx.post(server_url + "/v1/embeddings", json={"model": MODEL, "messages": messages}).json()
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    np.testing.assert_allclose(response["data"][0]["embedding"], last_token_embedding(hf, ids), atol=ATOL)


def test_vllm_pooling_route_answers_its_shape_with_the_same_vectors(server_url, client):
    inputs = ["one text", "another text"]
    pooled = httpx.post(server_url + "/pooling", json={"model": MODEL, "input": inputs}).json()
    assert pooled["object"] == "list" and pooled["model"] == MODEL and pooled["id"].startswith("pool-")
    assert [(d["index"], d["object"]) for d in pooled["data"]] == [(0, "pooling"), (1, "pooling")]
    embedded = client.embeddings.create(model=MODEL, input=inputs, encoding_format="float")
    for item, reference in zip(pooled["data"], embedded.data):
        assert item["data"] == reference.embedding
    assert pooled["usage"]["prompt_tokens"] == embedded.usage.prompt_tokens
    refused = httpx.post(server_url + "/pooling", json={"input": "x", "task": "classify"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "task"


@pytest.mark.parametrize("body, param, says", [
    ({"input": ""}, "input", "non-empty"),
    ({"input": []}, "input", "non-empty"),
    ({"input": [[]]}, "input", "non-empty"),
    ({"input": ["ok", ""]}, "input", "non-empty"),
    ({"model": MODEL}, "input", "input is required"),
    ({"input": [[1, 2], [3] * (MAX_MODEL_LEN + 1)]}, "input", f"Input 1 has {MAX_MODEL_LEN + 1} tokens"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
    ({"input": "x", "dimensions": 0}, "dimensions", "between 1 and"),
    ({"input": "x", "dimensions": 65}, "dimensions", "64 hidden dimensions"),
    ({"input": [[49152]]}, "input", "outside [0, 49152)"),
    ({"input": "x", "messages": [{"role": "user", "content": "y"}]}, "input", "not both"),
    ({"input": ["x"] * 257}, "input", "--max-seqs-per-request"),
])
def test_bad_requests_are_400s_naming_the_field(server_url, body, param, says):
    response = httpx.post(server_url + "/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_the_openai_client_raises_bad_request_for_an_empty_input(client):
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input="")
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")


def test_every_block_is_free_once_the_embeddings_are_answered(client, server_url):
    client.embeddings.create(model=MODEL, input=[[7] * 100, [8] * 3])
    wait_until(lambda: (s := stats(server_url))["num_free_blocks"] == s["num_total_blocks"])
