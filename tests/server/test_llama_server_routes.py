"""llama-server's native routes, as a llama.cpp client sends them: `/completion` (text or token
ids, `n_predict`, streaming, GBNF `grammar`, `json_schema`, `n_probs`, `logit_bias`, `stop`)
answers what `/v1/completions` answers, in llama-server's shape; `/props`, `/slots` and
`/health` report the engine; output-changing fields it cannot honour are refused by name; the
API key guards the routes as it guards /v1."""

from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import pytest

from pagedllm.cli import build_parser
from tests.server.common import MAX_MODEL_LEN, MODEL, SERVE_FLAGS, start_server_thread, wait_until

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "ignore_eos": True}
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5}, "pet": {"enum": ["cat", "dog"]}},
    "required": ["n", "pet"],
}


def complete(url: str, body: dict, route: str = "/completion", **kwargs) -> dict:
    response = httpx.post(url + route, json=body, timeout=60, **kwargs)
    assert response.status_code == 200, response.text
    return response.json()


def v1_text(url: str, prompt, max_tokens: int) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **GREEDY}
    return complete(url, body, "/v1/completions")["choices"][0]["text"]


def events(url: str, body: dict) -> list[dict]:
    """The `data:` payloads of a streamed /completion, in order."""
    with httpx.stream("POST", url + "/completion", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [json.loads(line[len("data: "):]) for line in lines]  # no [DONE]: json.loads would fail


def refusal(url: str, body: dict) -> dict:
    response = httpx.post(url + "/completion", json={"prompt": PROMPT, **body}, timeout=60)
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_a_text_prompt_completes_as_v1_completions_does_with_n_predict_honoured(server_url):
    result = complete(server_url, {"prompt": PROMPT, "n_predict": 8, **GREEDY})
    assert result["content"] == v1_text(server_url, PROMPT, 8)
    assert result["tokens_predicted"] == 8 and result["stop"] is True and result["stop_type"] == "limit"
    assert result["tokens_evaluated"] > 0 and result["truncated"] is False and result["model"] == MODEL
    assert result["generation_settings"]["n_predict"] == 8 and result["generation_settings"]["temperature"] == 0
    assert result["timings"]["predicted_n"] == 8 and result["timings"]["predicted_per_second"] > 0
    assert "completion_probabilities" not in result


def test_token_ids_and_a_list_of_prompts_complete_as_v1_does(server_url):
    ids = httpx.post(server_url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    result = complete(server_url, {"prompt": ids, "n_predict": 6, "return_tokens": True, **GREEDY})
    assert result["content"] == v1_text(server_url, ids, 6)
    assert len(result["tokens"]) == 6 and result["tokens_evaluated"] == len(ids)
    both = complete(server_url, {"prompt": [PROMPT, "Once upon a time"], "n_predict": 4, **GREEDY})
    assert [r["index"] for r in both] == [0, 1]
    assert [r["content"] for r in both] == [v1_text(server_url, p, 4) for p in (PROMPT, "Once upon a time")]


def test_the_completions_alias_and_n_predict_zero(server_url):
    assert complete(server_url, {"prompt": PROMPT, "n_predict": 5, **GREEDY}, "/completions")["tokens_predicted"] == 5
    nothing = complete(server_url, {"prompt": PROMPT, "n_predict": 0})
    assert (nothing["content"], nothing["tokens_predicted"], nothing["stop_type"]) == ("", 0, "limit")


def test_streaming_gives_the_same_content_and_ends_with_the_whole_result(server_url):
    body = {"prompt": PROMPT, "n_predict": 10, **GREEDY}
    full = complete(server_url, body)
    streamed = events(server_url, body)
    assert len(streamed) >= 3 and all(e["stop"] is False for e in streamed[:-1])
    assert "".join(e["content"] for e in streamed) == full["content"]
    assert sum(len(e["tokens"]) for e in streamed[:-1]) == 10
    last = streamed[-1]
    assert last["stop"] is True and last["stop_type"] == "limit" and last["tokens_predicted"] == 10
    assert last["timings"]["predicted_n"] == 10


def test_a_stop_word_ends_the_text_before_it(server_url):
    text = complete(server_url, {"prompt": PROMPT, "n_predict": 12, **GREEDY})["content"]
    word = text.strip()[:2]
    assert len(word) == 2
    result = complete(server_url, {"prompt": PROMPT, "n_predict": 12, "stop": [word], **GREEDY})
    assert result["content"] == text[: text.index(word)]
    assert (result["stop_type"], result["stopping_word"]) == ("word", word)


def test_a_gbnf_grammar_constrains_sampled_output_over_seeds(server_url):
    for seed in range(6):
        body = {"prompt": "Answer:", "grammar": 'root ::= ("yes" | "no")', "temperature": 1.0, "seed": seed,
                "n_predict": 8, "stream": seed % 2 == 1}
        if body["stream"]:
            streamed = events(server_url, body)
            content, last = "".join(e["content"] for e in streamed), streamed[-1]
        else:
            last = complete(server_url, body)
            content = last["content"]
        assert content in ("yes", "no"), content
        assert last["stop_type"] == "eos" and last["generation_settings"]["grammar"].startswith("root")


def test_a_json_schema_constrains_sampled_output_over_seeds(server_url):
    for seed in range(4):
        body = {"prompt": "A pet:", "json_schema": SCHEMA, "temperature": 1.0, "seed": seed, "n_predict": 40}
        jsonschema.validate(json.loads(complete(server_url, body)["content"]), SCHEMA)


def test_n_probs_gives_n_ranked_tokens_per_generated_token_with_the_chosen_one(server_url):
    result = complete(server_url, {"prompt": PROMPT, "n_predict": 4, "n_probs": 3, "return_tokens": True, **GREEDY})
    probs = result["completion_probabilities"]
    assert [p["id"] for p in probs] == result["tokens"]
    for entry in probs:
        top = entry["top_logprobs"]
        assert len(top) == 3 and len({t["id"] for t in top}) == 3
        assert top[0]["id"] == entry["id"] and top[0]["logprob"] == pytest.approx(entry["logprob"])  # greedy
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
    streamed = events(server_url, {"prompt": PROMPT, "n_predict": 4, "n_probs": 3, **GREEDY})
    assert [p["id"] for e in streamed[:-1] for p in e.get("completion_probabilities", [])] == result["tokens"]


def test_logit_bias_false_bans_the_greedy_token(server_url):
    first = complete(server_url, {"prompt": PROMPT, "n_predict": 1, "return_tokens": True, **GREEDY})["tokens"][0]
    for bias in ([[first, False]], {str(first): False}):
        banned = complete(server_url, {"prompt": PROMPT, "n_predict": 1, "return_tokens": True, "logit_bias": bias, **GREEDY})
        assert banned["tokens"][0] != first


@pytest.mark.parametrize("body, param", [
    ({"mirostat": 2}, "mirostat"),
    ({"typical_p": 0.5}, "typical_p"),
    ({"dry_multiplier": 0.8}, "dry_multiplier"),
    ({"n_probs": 50}, "n_probs"),
    ({"n_predict": -2}, "n_predict"),
    ({"repeat_penalty": 1.1, "repeat_last_n": 64}, "repeat_last_n"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"grammar": "root ::= nothing-defined"}, "grammar"),
    ({"samplers": ["top_k", "bogus"]}, "samplers"),
    ({"repeat_penalty": 5.0}, "repeat_penalty"),
])
def test_fields_that_would_change_the_output_unhonoured_are_refused_by_name(server_url, body, param):
    error = refusal(server_url, body)
    assert error["param"] == param and param in error["message"]


def test_unsupported_samplers_sent_switched_off_are_accepted(server_url):
    off = {"mirostat": 0, "typical_p": 1.0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "repeat_last_n": 64,
           "samplers": ["dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"], "cache_prompt": True,
           "id_slot": -1, "n_keep": 0}
    result = complete(server_url, {"prompt": PROMPT, "n_predict": 6, **GREEDY, **off})
    assert result["content"] == v1_text(server_url, PROMPT, 6)


def test_props_reports_the_context_slots_and_template(server_url):
    props = httpx.get(server_url + "/props").json()
    model = httpx.get(server_url + "/v1/models").json()["data"][0]
    assert props["default_generation_settings"]["n_ctx"] == model["max_model_len"] == MAX_MODEL_LEN
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8
    assert props["total_slots"] == 256 and props["build_info"].startswith("pagedllm ")
    assert isinstance(props["chat_template"], str) and props["chat_template"]
    assert props["modalities"] == {"vision": False, "audio": False}
    refused = httpx.post(server_url + "/props", json={"n_ctx": 4})
    assert refused.status_code == 400 and "read-only" in refused.json()["error"]["message"]


def test_slots_list_a_running_request_and_nothing_once_it_ends(server_url):
    wait_until(lambda: httpx.get(server_url + "/slots").json() == [])
    first_event = threading.Event()
    seen: list[dict] = []

    def stream() -> None:
        body = {"prompt": PROMPT, "n_predict": 200, "stream": True, **GREEDY}
        with httpx.stream("POST", server_url + "/completion", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    seen.append(json.loads(line[len("data: "):]))
                    first_event.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert first_event.wait(60)
    slots = httpx.get(server_url + "/slots").json()
    thread.join(60)
    assert len(slots) == 1 and slots[0]["is_processing"] is True
    assert slots[0]["id"] == seen[0]["id_slot"] and slots[0]["n_ctx"] == MAX_MODEL_LEN
    assert slots[0]["next_token"]["n_decoded"] >= 1 and slots[0]["params"]["n_predict"] == 200
    assert seen[-1]["stop"] is True and seen[-1]["tokens_predicted"] == 200
    wait_until(lambda: httpx.get(server_url + "/slots").json() == [])
    refused = httpx.post(server_url + "/slots/0", params={"action": "erase"})
    assert refused.status_code == 400 and "not supported" in refused.json()["error"]["message"]


def test_health_answers_json(server_url):
    response = httpx.get(server_url + "/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


@pytest.fixture(scope="module")
def keyed_url(tiny_llama):
    args = build_parser().parse_args(["serve", str(tiny_llama), "--port", "0", *SERVE_FLAGS, "--api-key", "k1"])
    server, thread, url = start_server_thread(args)
    yield url
    server.should_exit = True
    thread.join(30)


def test_the_api_key_guards_the_llama_routes_but_not_health(keyed_url):
    body = {"prompt": PROMPT, "n_predict": 2}
    for method, route in (("POST", "/completion"), ("POST", "/completions"), ("GET", "/props"), ("GET", "/slots")):
        response = httpx.request(method, keyed_url + route, json=body if method == "POST" else None, timeout=60)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key", route
        response = httpx.request(method, keyed_url + route, json=body if method == "POST" else None, timeout=60,
                                 headers={"authorization": "Bearer k1"})
        assert response.status_code == 200, route
    assert httpx.get(keyed_url + "/health").json() == {"status": "ok"}


def test_tokenize_and_detokenize_take_llama_servers_names(server_url):
    """llama-server's /tokenize takes `content` and /detokenize answers `content`."""
    ours = httpx.post(server_url + "/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    theirs = httpx.post(server_url + "/tokenize", json={"content": "Hello there"}).json()["tokens"]
    assert theirs == ours and ours
    text = httpx.post(server_url + "/detokenize", json={"tokens": ours}).json()
    assert text["content"] == text["prompt"] and "Hello there" in text["content"]
    both = httpx.post(server_url + "/tokenize", json={"content": "a", "prompt": "b"})
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("prompt", [[[5], 7, "x"], [1, -3], [1, 1 << 40], ["a", [2, 10**9]], []])
def test_a_prompt_of_no_reading_or_with_token_ids_out_of_the_vocabulary_is_a_400(server_url, prompt):
    """Found by the fuzzer: such prompts were a 500 (a nested list tokenized as text, ids past the vocabulary)."""
    reply = httpx.post(server_url + "/completion", json={"prompt": prompt, "n_predict": 1})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt", reply.text
    assert httpx.get(server_url + "/health").status_code == 200
