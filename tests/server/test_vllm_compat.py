"""vLLM's flag and field names: a server started with vLLM-style flags (several API keys, CORS, a
root path, a chat template, a generation config, a block count override, flags that change
nothing) behaves as each says; vLLM's argument names work offline too."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from pagedllm.cli import build_parser
from pagedllm.config import EngineArgs
from tests.server.common import SERVE_FLAGS, start_server_thread

KEYS = ["k1", "k2", "k3"]
ORIGIN = "https://app.example"
ROOT = "/llm"
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
NUM_BLOCKS = 40
GENERATION_CONFIG = {"temperature": 0.0, "max_new_tokens": 5, "top_k": 50}  # top_k 50 is transformers' default
INERT_FLAGS = ["--trust-remote-code", "--enable-chunked-prefill", "--disable-log-requests",
               "--tokenizer-mode", "auto"]


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def log():
    handler = Records()
    logger = logging.getLogger("pagedllm")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture(scope="module")
def compat_url(tiny_llama, tmp_path_factory, log):
    config_dir = tmp_path_factory.mktemp("generation-config")
    (config_dir / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    flags = ["serve", str(tiny_llama), "--port", "0", *SERVE_FLAGS,
             "--api-key", "k1", "--api-key", "k2", "k3", "--allowed-origins", json.dumps([ORIGIN]),
             "--root-path", ROOT, "--chat-template", TEMPLATE, "--trust-request-chat-template", "--generation-config", str(config_dir),
             "--num-gpu-blocks-override", str(NUM_BLOCKS), "--dtype", "float", "--enforce-eager", *INERT_FLAGS]
    server, thread, url = start_server_thread(build_parser().parse_args(flags))
    yield url
    server.should_exit = True
    thread.join(30)


def auth(key: str = "k1") -> dict:
    return {"authorization": f"Bearer {key}"}


def post(url: str, route: str, body: dict, key: str = "k1") -> httpx.Response:
    return httpx.post(url + route, json={"model": "tiny", **body}, headers=auth(key), timeout=60)


def test_any_of_several_api_keys_is_accepted_and_others_refused(compat_url):
    for key in KEYS:
        assert httpx.get(compat_url + "/v1/models", headers=auth(key)).status_code == 200
    for headers in (auth("k4"), auth("k1k2"), {}):
        response = httpx.get(compat_url + "/v1/models", headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_cors_preflight_allows_the_configured_origin_only(compat_url):
    preflight = {"access-control-request-method": "POST", "access-control-request-headers": "authorization"}
    allowed = httpx.options(compat_url + "/v1/completions", headers={"origin": ORIGIN, **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in allowed.headers["access-control-allow-methods"]
    other = httpx.options(compat_url + "/v1/completions", headers={"origin": "https://evil.example", **preflight})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    simple = httpx.get(compat_url + "/v1/models", headers={"origin": ORIGIN, **auth()})
    assert simple.headers["access-control-allow-origin"] == ORIGIN


def test_routes_answer_with_and_without_the_root_path(compat_url):
    assert httpx.get(compat_url + ROOT + "/v1/models", headers=auth()).json()["data"][0]["id"] == "tiny"
    assert httpx.get(compat_url + "/v1/models", headers=auth()).status_code == 200
    assert httpx.get(compat_url + "/openapi.json").json()["servers"] == [{"url": ROOT}]


def test_the_chat_template_flag_and_request_fields_shape_the_prompt(compat_url, tokenizer):
    messages = [{"role": "user", "content": "Hello there"}]

    def prompt_tokens(**fields) -> int:
        response = post(compat_url, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, **fields})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    assert prompt_tokens() == count("<user>Hello there<assistant>")
    tokens = httpx.post(compat_url + "/tokenize", json={"messages": messages}, headers=auth()).json()["tokens"]
    assert tokens == tokenizer.encode("<user>Hello there<assistant>", add_special_tokens=False)
    own = "{{ greeting }}{% for m in messages %}{{ m.content | upper }}{% endfor %}"
    assert prompt_tokens(chat_template=own, chat_template_kwargs={"greeting": "Dear model: "}) == count(
        "Dear model: HELLO THERE"
    )


@pytest.mark.parametrize("fields, param", [
    ({"chat_template": "{% for m in messages %}{{ m.content }"}, "chat_template"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
])
def test_a_bad_request_chat_template_is_a_400_naming_it(compat_url, fields, param):
    response = post(compat_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **fields})
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_a_request_chat_template_is_refused_unless_trusted(server_url):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ messages[0].content }}"}
    response = httpx.post(server_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in response.json()["error"]["message"]


def test_generation_config_gives_the_defaults_of_fields_a_request_leaves_unset(compat_url):
    def completion(**fields) -> dict:
        response = post(compat_url, "/v1/completions", {"prompt": "Once upon a time", "ignore_eos": True, **fields})
        assert response.status_code == 200, response.text
        return response.json()

    # max_new_tokens caps max_tokens, as in vLLM: the default 16, a larger one, and none (chat).
    cap = GENERATION_CONFIG["max_new_tokens"]
    assert completion()["usage"]["completion_tokens"] == cap
    assert completion(max_tokens=12)["usage"]["completion_tokens"] == cap
    assert completion(max_tokens=3)["usage"]["completion_tokens"] == 3
    chat = post(compat_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
    assert chat.json()["usage"]["completion_tokens"] == cap
    greedy = completion(temperature=0)["choices"][0]["text"]
    assert completion()["choices"][0]["text"] == greedy  # the config's temperature 0
    assert completion(temperature=1.0, seed=7)["choices"][0]["text"] != greedy


def test_num_gpu_blocks_override_sets_the_block_count(compat_url):
    assert httpx.get(compat_url + "/stats", headers=auth()).json()["num_total_blocks"] == NUM_BLOCKS


def test_flags_that_change_nothing_are_logged_once_each(compat_url, log):
    for flag in ("--trust-remote-code", "--enable-chunked-prefill", "--disable-log-requests",
                 "--tokenizer-mode auto"):
        assert sum(m.startswith("Ignoring " + flag + ":") for m in log.messages) == 1, flag


def test_unknown_request_fields_are_logged_once_per_field_name(compat_url, log):
    for _ in range(3):
        response = post(compat_url, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "frobnicate": 1, "wibble": "x"})
        assert response.status_code == 200
    for name in ("frobnicate", "wibble"):
        assert sum(f"{name!r} is not known" in m for m in log.messages) == 1


def test_vllm_argument_names_parse_to_ours():
    parser = build_parser()
    args = parser.parse_args(["serve", "m", "--kv-cache-memory-bytes", "1GiB", "--num-gpu-blocks-override", "7",
                              "--dtype", "half", "--api-key", "a", "b", "--api-key", "c"])
    assert (args.kv_cache_memory, args.num_gpu_blocks, args.api_key) == (1 << 30, 7, ["a", "b", "c"])
    assert EngineArgs(dtype=args.dtype).dtype == "float16" and EngineArgs(dtype="float").dtype == "float32"
    offline = EngineArgs.from_kwargs(kv_cache_memory_bytes=1 << 20, num_gpu_blocks_override=9, trust_remote_code=True)
    assert (offline.kv_cache_memory, offline.num_gpu_blocks) == (1 << 20, 9)
    with pytest.raises(TypeError, match="not both"):
        EngineArgs.from_kwargs(num_gpu_blocks_override=9, num_gpu_blocks=9)


def test_generation_config_choices(tiny_llama, tmp_path):
    from pagedllm.entrypoints.generation_config import default_sampling

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "do_sample": True}))
    assert default_sampling(str(tmp_path), "ignored") == {"temperature": 0.6, "top_p": 0.9}
    assert default_sampling("vllm", str(tmp_path)) == {}
    assert default_sampling("auto", str(tmp_path)) == {"temperature": 0.6, "top_p": 0.9}
    assert default_sampling("auto", str(tiny_llama)) == {}  # transformers wrote no sampling fields
    with pytest.raises(ValueError, match="generation_config"):
        default_sampling(str(tmp_path / "missing"), "m")
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="temperature .* must be a number"):
        default_sampling(str(tmp_path), "m")


def test_llm_takes_vllm_names_and_samples_by_the_generation_config(tiny_llama, tmp_path):
    from pagedllm import LLM, SamplingParams

    (tmp_path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    llm = LLM(str(tiny_llama), dtype="float", num_gpu_blocks_override=NUM_BLOCKS, kv_cache_memory_bytes=None,
              trust_remote_code=True, enforce_eager=True, max_model_len=256, generation_config=str(tmp_path))
    assert llm.llm_engine.get_stats().num_total_blocks == NUM_BLOCKS
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, GENERATION_CONFIG["max_new_tokens"])
    out = llm.generate("Once upon a time", use_tqdm=False)[0].outputs[0]
    greedy = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy.token_ids and len(out.token_ids) <= GENERATION_CONFIG["max_new_tokens"]


def test_chat_template_flag_takes_a_file_or_a_template(tmp_path):
    from pagedllm.entrypoints.openai.server_options import load_chat_template

    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE == load_chat_template(TEMPLATE)
    assert "<|im_start|>" in load_chat_template("chatml")  # llama-server's name of one
    with pytest.raises(ValueError, match="neither a readable file, a Jinja template nor chatml"):
        load_chat_template(str(tmp_path / "missing.jinja"))


@pytest.mark.parametrize("method, route, body", [
    ("POST", "/tokenize", {"prompt": "Hi"}), ("POST", "/detokenize", {"tokens": [1]}), ("GET", "/stats", None),
    ("GET", "/version", None), ("GET", "/props", None),
])
def test_every_route_but_health_and_metrics_needs_the_key(compat_url, method, route, body):
    """Issue 51: /tokenize and /stats were open with --api-key set, so anyone could make the
    server tokenize for them or read its load."""
    assert httpx.request(method, compat_url + route, json=body).status_code == 401
    assert httpx.request(method, compat_url + route, json=body, headers=auth()).status_code == 200
    for open_route in ("/health", "/metrics"):
        assert httpx.get(compat_url + open_route).status_code == 200
