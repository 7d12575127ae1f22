"""Launch lines as users of vLLM and llama-server type them: each flag that means something here
does what it says (threads, batch, context, KV dtype, served name, default sampling), those that
mean nothing are accepted with one warning each, those of features not built are refused by name
with what to use instead, and a server started with a llama-server line serves a GGUF file
without a chat template under its file name, with ChatML."""

from __future__ import annotations

import logging

import httpx
import pytest
import torch

from pagedllm.cli import build_parser, main, parse_command_line
from pagedllm.config import DEFAULT_MODEL
from pagedllm.entrypoints.cli_args import engine_args_from, prepare_engine_namespace
from pagedllm.entrypoints.launch_flags import REFUSED, parse_count
from pagedllm.entrypoints.openai.cli_serve import default_sampling_flags, served_model_names


def parsed(line: str):
    args = parse_command_line(build_parser(), line.split())
    prepare_engine_namespace(args)
    return args


@pytest.mark.parametrize("text, count", [("4096", 4096), ("4k", 4000), ("4K", 4096), ("25.6k", 25600),
                                         ("1M", 1 << 20), ("2m", 2_000_000), ("auto", None), ("-1", None)])
def test_counts_read_as_vllm_reads_them(text, count):
    assert parse_count(text) == count


def test_a_vllm_launch_line_sets_what_each_flag_says():
    args = parsed("serve --model /models/x --max-model-len 4k --max-num-seqs 8 --max-num-batched-tokens 2K "
                  "--kv-cache-dtype bfloat16 -tp 1 --served-model-name a b --no-enable-prefix-caching --seed 3 "
                  "--enable-auto-tool-choice --tool-call-parser hermes --task generate --runner auto -q gguf")
    engine = engine_args_from(args)
    assert engine.model == args.model == "/models/x"
    assert (engine.max_model_len, engine.max_num_seqs, engine.max_num_batched_tokens) == (4000, 8, 2048)
    assert (engine.kv_cache_dtype, engine.enable_prefix_caching, engine.seed) == ("bfloat16", False, 3)
    assert served_model_names(args) == ["a", "b"]


def test_a_llama_server_launch_line_sets_what_each_flag_says():
    args = parsed("serve -m /models/x.gguf -c 2048 -np 4 -t 2 -b 512 -ctk f16 -ctv f16 -a smol --host 0.0.0.0 "
                  "--port 8080 -s 7 --temp 0.7 --top-k 40 --top-p 0.9 --min-p 0.05 --repeat-penalty 1.1 -n 128")
    engine = engine_args_from(args)
    assert engine.model == "/models/x.gguf"
    assert (engine.max_model_len, engine.max_num_seqs, engine.threads, engine.max_num_batched_tokens) == (2048, 4, 2, 512)
    assert (engine.kv_cache_dtype, engine.seed) == ("float16", 7)
    assert (served_model_names(args), args.host, args.port) == (["smol"], "0.0.0.0", 8080)
    assert default_sampling_flags(args) == {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05,
                                            "repetition_penalty": 1.1, "max_tokens": 128}
    # -c 0 is the model's own context; -n -1 no cap.
    args = parsed("serve -c 0 -n -1")
    assert engine_args_from(args).max_model_len is None and default_sampling_flags(args) == {}


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "llama4_json", "mistral", "pythonic", "llama4_pythonic",
                                  "qwen3_xml", "qwen3_coder", "phi4_mini_json"])
def test_every_tool_call_parser_of_vllm_built_here_is_accepted(name):
    from pagedllm.entrypoints.launch_flags import apply_launch_flags
    from pagedllm.entrypoints.openai.api_server import server_options_from
    from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS

    args = parsed(f"serve --model /models/x --enable-auto-tool-choice --tool-call-parser {name}")
    apply_launch_flags(args)
    assert TOOL_PARSERS[server_options_from(args).tool_call_parser] is TOOL_PARSERS[name]


@pytest.mark.parametrize("command", ["generate hi", "chat", "serve", "demo"])
def test_every_command_takes_the_model_alike(command):
    assert parsed(f"{command} --model /models/x").model == "/models/x"
    assert parsed(f"{command} -m /models/x -t 1").model == "/models/x"
    assert parsed(command).model == DEFAULT_MODEL
    if command != "generate hi":  # generate's positional arguments are prompts
        assert parsed(f"{command} /models/x").model == "/models/x"
        with pytest.raises(ValueError, match="Two models given"):
            parsed(f"{command} /models/x --model /models/y")


def test_flags_that_mean_nothing_here_are_accepted_with_one_warning_each(caplog):
    line = ("serve -O3 --compilation-config {} --gpu-memory-utilization 0.8 --trust-remote-code -ngl 99 --mlock "
            "-fa on --jinja --no-mmap -cb --disable-log-requests")
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        args = parsed(line)
        prepare_engine_namespace(args)  # once per command: a second call warns no more
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for flag in ("-O 3", "--compilation-config", "--gpu-memory-utilization 0.8", "--trust-remote-code", "-ngl 99",
                 "--mlock", "-fa on", "--jinja", "--no-mmap", "-cb", "--disable-log-requests"):
        assert sum(message.startswith(f"Ignoring {flag}") for message in warnings) == 1, (flag, warnings)
    assert len(warnings) == 11


@pytest.mark.parametrize("flags", [["--lora-modules", "a=/x"], ["--enable-lora"], ["--reasoning-budget", "0"],
                                   ["--speculative-model", "/x"], ["--uds", "/tmp/s"], ["-hf", "a/b"]])
def test_flags_of_features_not_built_are_refused_by_name_with_what_to_use(flags, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", *flags])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"{flags[0]}: {REFUSED[flags[0]]}" in err
    assert err.startswith("usage: pagedllm serve [MODEL] [options]") and err.count("\n") <= 3  # no usage dump


@pytest.mark.parametrize("flags, named, instead", [
    (["--task", "classify"], "--task classify", "--task embed"),
    (["--runner", "draft"], "--runner draft", "--runner pooling"),
    (["--pooling", "rank"], "--pooling 'rank'", "LAST, MEAN or CLS"),
    (["--pooler-config", "{\"softmax\": true}"], "pooler_config has key(s) not built", "pooling_type"),
    (["--data-parallel-size", "2"], "--data-parallel-size", "load balancer"),
    (["-pp", "2"], "--pipeline-parallel-size", "--tensor-parallel-size"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8", "bfloat16"),
    (["-ctk", "q8_0"], "-ctk q8_0", "f16 or bf16"),
    (["-ctk", "f16", "-ctv", "f32"], "-ctk and -ctv differ", "same type"),
    (["--tool-call-parser", "granite"], "--tool-call-parser granite", "hermes, llama3_json, llama4_json, mistral, pythonic"),
    (["--reasoning-parser", "deepseek"], "--reasoning-parser deepseek", "deepseek_r1, qwen3, glm45"),
    (["--reasoning-format", "deepseek-legacy"], "--reasoning-format deepseek-legacy", "none, auto, deepseek"),
    (["--reasoning-format", "auto", "--reasoning-parser", "qwen3"], "Give --reasoning-parser or --reasoning-format",
     "not both"),
    (["--quantization", "awq"], "--quantization awq", "Drop --quantization"),
])
def test_values_not_served_here_are_refused_by_name_before_the_model_loads(flags, named, instead, capsys):
    assert main(["serve", "/no/such/model", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pagedllm: error: {named}") and instead in err and err.count("\n") == 1


@pytest.mark.parametrize("line, pooler", [
    ("serve --task embed", None),
    ("serve --runner pooling --convert embed --override-pooler-config {\"pooling_type\":\"MEAN\"}",
     '{"pooling_type":"MEAN"}'),
    ("serve --embedding --pooling cls", '{"pooling_type": "CLS", "normalize": true}'),
    ("serve --embeddings --pooling-type mean --pooler-config {\"normalize\":false}",
     '{"pooling_type": "MEAN", "normalize": false}'),
])
def test_embedding_launch_lines_are_accepted_and_set_the_pooling(line, pooler):
    assert engine_args_from(parsed(line)).pooler_config == pooler


@pytest.mark.parametrize("line, parser", [
    ("serve --reasoning-parser deepseek_r1", "deepseek_r1"),
    ("serve --enable-reasoning --reasoning-parser qwen3", "qwen3"),  # vLLM's older switch, now implied
    ("serve --reasoning-format deepseek", "auto"),  # llama-server's: picked from the chat template
    ("serve --reasoning-format auto", "auto"),
    ("serve --reasoning-format none", None),
    ("serve", None),
])
def test_reasoning_launch_lines_choose_the_parser(line, parser):
    from pagedllm.entrypoints.openai.api_server import server_options_from

    assert server_options_from(parsed(line)).reasoning_parser == parser


def test_a_mistyped_flag_is_named_under_its_commands_usage_with_the_closest_ones(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--max-model-length", "512"])
    err = capsys.readouterr().err
    assert err.startswith("usage: pagedllm serve")
    assert "unrecognized arguments: --max-model-length" in err and "did you mean --max-model-len" in err


@pytest.fixture(scope="module")
def template_less_gguf(tmp_path_factory):
    """A 2-layer Llama GGUF of random Q8_0 blocks with the default model's tokenizer and no chat template."""
    from pagedllm.transformers_utils import resolve_model
    from tests.gguf_writer import tokenizer_fields, write_random_llama

    path = tmp_path_factory.mktemp("launch") / "tiny-q8.gguf"
    return write_random_llama(path, {"default": "Q8_0"}, hidden=128, intermediate=256, vocab=49152,
                              tokenizer=tokenizer_fields(resolve_model(None).path))


def test_a_llama_server_line_serves_a_gguf_without_a_template_under_its_file_name(template_less_gguf, caplog):
    from transformers import AutoTokenizer  # noqa: F401  (imported before the server: not under its clock)

    from pagedllm.engine.async_llm_engine import AsyncLLMEngine
    from pagedllm.config import CHATML_TEMPLATE
    from tests.server.common import start_server_thread

    line = (f"serve -m {template_less_gguf} -t 1 --no-adapt-cpu-threads -np 3 -c 256 -ctk bf16 -ctv bf16 "
            "--kv-cache-memory 16MiB --port 0 --int8-activations off --uvicorn-log-level warning -ngl 99 --jinja")
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        args = parsed(line)
        engine = AsyncLLMEngine.from_engine_args(engine_args_from(args))
        server, thread, url = start_server_thread(args, engine)
    try:
        # -t 1, read on the engine's thread (OpenMP's count is per thread; the default is every core)
        assert engine.engine.executor.worker.num_threads == 1
        assert engine.engine.config.scheduler.max_num_seqs == 3  # -np 3
        assert engine.engine.executor.worker.cache_dtype == torch.bfloat16  # -ctk/-ctv bf16
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["tiny-q8", str(template_less_gguf)]
        assert models[0]["max_model_len"] == 256
        assert any("has no chat template; chat uses ChatML" in r.getMessage() for r in caplog.records)
        messages = [{"role": "user", "content": "Hi"}]
        for name in ("tiny-q8", str(template_less_gguf)):  # the stem and the full path both match
            reply = httpx.post(url + "/v1/chat/completions", json={"model": name, "messages": messages,
                                                                   "max_tokens": 2, "temperature": 0})
            assert reply.status_code == 200, reply.text
            assert reply.json()["model"] == name  # answered under the name asked for
        tokens = httpx.post(url + "/tokenize", json={"messages": messages}).json()["tokens"]
        import jinja2

        chatml = jinja2.Template(CHATML_TEMPLATE).render(messages=messages, add_generation_prompt=True)
        expected = httpx.post(url + "/tokenize", json={"prompt": chatml, "add_special_tokens": False}).json()["tokens"]
        assert tokens == expected
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_chat_says_a_model_has_no_template_before_the_first_message(tiny_models, tmp_path, monkeypatch, capsys):
    """A model folder without a chat template (OPT's): `pagedllm chat` stops before asking for a
    message, naming --chat-template; with one given it chats."""
    import json
    import shutil

    shutil.copytree(tiny_models("opt"), tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "")
    flags = ["--max-model-len", "64", "--num-gpu-blocks", "16", "--max-tokens", "2"]
    assert main(["chat", str(tmp_path), *flags]) == 2
    assert "has no chat template; give one with --chat-template" in capsys.readouterr().err and asked == []
    assert main(["chat", str(tmp_path), *flags, "--chat-template", "chatml"]) == 0
    assert asked == ["you> "]  # an empty line ends the conversation


def test_a_vllm_config_file_gives_flags_that_the_command_line_overrides(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("model: /models/x\nmax_model_len: 2k\nmax-num-seqs: 8\nenable_prefix_caching: false\n"
                      "served-model-name: [a, b]\nspeculative_config: {method: ngram, num_speculative_tokens: 4}\n")
    args = parsed(f"serve --config {config} --max-num-seqs 4")
    engine = engine_args_from(args)
    assert (engine.model, engine.max_model_len, engine.max_num_seqs) == ("/models/x", 2000, 4)
    assert engine.enable_prefix_caching is False and served_model_names(args) == ["a", "b"]
    assert engine.speculative_config == '{"method": "ngram", "num_speculative_tokens": 4}'


def test_ssl_flags_serve_https(tiny_llama, tmp_path):
    """vLLM's --ssl-keyfile/--ssl-certfile: the server answers over HTTPS with that certificate."""
    import shutil
    import subprocess

    from tests.server.common import SERVE_FLAGS, start_server_thread

    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    args = parsed(f"serve {tiny_llama} --port 0 --ssl-keyfile {key} --ssl-certfile {cert} " + " ".join(SERVE_FLAGS))
    server, thread, url = start_server_thread(args)
    try:
        https = url.replace("http://", "https://")
        assert httpx.get(https + "/health", verify=str(cert)).json() == {"status": "ok"}
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health")  # plain HTTP is not served
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_override_generation_config_gives_default_sampling():
    args = parsed("""serve --override-generation-config {"temperature":0.2,"top_k":5,"max_new_tokens":9} --top-k 7""")
    assert default_sampling_flags(args) == {"temperature": 0.2, "top_k": 7, "max_tokens": 9}  # llama-server's --top-k wins
    with pytest.raises(ValueError, match="top_k must be an integer"):
        default_sampling_flags(parsed("""serve --override-generation-config {"top_k":0.5}"""))
