"""The llama.cpp peer (`bench throughput --backend llama-cpp`, `bench llama-cpp`, `bench spec
--llama-cpp`): the build's command lines, `llama-server`'s arguments and a fake server that
answers as it does (llama.cpp is never built by the tests), `/completion`'s answers, and
`llama-bench`'s JSON."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

from pagedllm.bench import llama_cpp_peer
from pagedllm.bench.datasets import BenchRequest
from pagedllm.bench.llama_cpp_peer import (
    LlamaCppPeerError, built_binaries, completion_payload, ensure_llama_cpp, greedy_payload, llama_bench_command,
    ngram_simple_args, parse_completion, parse_greedy_completion, parse_llama_bench, run_llama_server, server_command,
)
from pagedllm.cli import main

# `llama-bench -o json` of llama.cpp as built here (one pp and one tg test), cut to the fields
# read and a few beside them.
LLAMA_BENCH_JSON = """[
  {"build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC", "gpu_info": "", "backends": "CPU",
   "model_filename": "1b-q4_k_m.gguf", "model_type": "llama 1B Q4_K - Medium", "model_size": 667000000,
   "model_n_params": 1073809408, "n_batch": 2048, "n_ubatch": 512, "n_threads": 2, "type_k": "f16",
   "n_prompt": 512, "n_gen": 0, "test_time": "2026-12-02T18:00:00Z", "avg_ns": 10000000000,
   "stddev_ns": 10000000, "avg_ts": 51.2, "stddev_ts": 0.4, "samples_ns": [1, 2, 3], "samples_ts": [51.0, 51.2, 51.4]},
  {"build_commit": "0c1e570", "build_number": 1, "cpu_info": "AMD EPYC", "gpu_info": "", "backends": "CPU",
   "model_filename": "1b-q4_k_m.gguf", "model_type": "llama 1B Q4_K - Medium", "model_size": 667000000,
   "model_n_params": 1073809408, "n_batch": 2048, "n_ubatch": 512, "n_threads": 2, "type_k": "f16",
   "n_prompt": 0, "n_gen": 128, "test_time": "2026-12-02T18:00:10Z", "avg_ns": 8000000000,
   "stddev_ns": 10000000, "avg_ts": 16.0, "stddev_ts": 0.1, "samples_ns": [1, 2, 3], "samples_ts": [15.9, 16.0, 16.1]}
]"""

# Answers /health and /completion as llama-server does: each completion predicts n_predict
# tokens (fewer when FAKE_SHORT is set), each the prompt's last token; started with --spec-type,
# it reports two proposed tokens per output token, half of them accepted. Its arguments and
# every request it was sent are appended to a log.
FAKE_SERVER = textwrap.dedent(
    """
    import json, os, sys, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    log = os.environ["FAKE_LOG"]
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def answer(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            self.answer({"status": "ok"})
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock, open(log, "a") as f:
                f.write(json.dumps(body) + "\\n")
            n = body["n_predict"] - (1 if os.environ.get("FAKE_SHORT") else 0)
            timings = {"predicted_n": n}
            if "--spec-type" in args:
                timings.update(draft_n=2 * n, draft_n_accepted=n)
            self.answer({"content": "x", "tokens": [body["prompt"][-1]] * n, "tokens_predicted": n,
                         "tokens_evaluated": len(body["prompt"]), "stop_type": "limit", "timings": timings})

    with open(log, "a") as f:
        f.write(json.dumps({"argv": args}) + "\\n")
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


@pytest.fixture
def fake_build(tmp_path):
    """A llama.cpp build folder whose llama-server is the fake above."""
    binaries = tmp_path / "build" / "bin"
    binaries.mkdir(parents=True)
    server = binaries / "llama-server"
    server.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    server.chmod(0o755)
    for name in llama_cpp_peer.TARGETS[1:]:  # (llama-quantize, llama-bench, llama-perplexity)
        (binaries / name).write_text("#!/bin/sh\nexit 0\n")
        (binaries / name).chmod(0o755)
    (tmp_path / llama_cpp_peer._STAMP).write_text("fake\n")
    return binaries


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _logged(log: Path) -> tuple[list[str], list[dict]]:
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    return lines[0]["argv"], lines[1:]


def test_llama_bench_json_becomes_pp_and_tg_rows():
    pp, tg = parse_llama_bench(LLAMA_BENCH_JSON)
    assert (pp["test"], pp["tok_per_s"], pp["stddev_tok_per_s"], pp["threads"]) == ("pp512", 51.2, 0.4, 2)
    assert (tg["test"], tg["tok_per_s"]) == ("tg128", 16.0)
    assert tg["model_params"] == 1073809408 and tg["model_gib"] == pytest.approx(667000000 / 2**30)


def test_llama_bench_command_asks_for_json_at_the_given_threads(fake_build):
    command = llama_bench_command(fake_build, Path("m.gguf"), threads=2, n_prompt=256, n_gen=64, repetitions=5)
    assert command[0] == str(fake_build / "llama-bench")
    flags = dict(zip(command[1::2], command[2::2]))
    assert flags == {"-m": "m.gguf", "-t": "2", "-p": "256", "-n": "64", "-r": "5", "-o": "json"}


def test_server_command_gives_each_slot_the_context_and_batches_continuously(fake_build):
    command = server_command(fake_build, Path("m.gguf"), port=9000, parallel=16, slot_context=2048, threads=2)
    assert command[0] == str(fake_build / "llama-server") and "--cont-batching" in command
    flags = {a: b for a, b in zip(command, command[1:]) if a.startswith("-")}
    assert (flags["-np"], flags["-c"], flags["-t"], flags["-tb"], flags["--port"]) == ("16", str(16 * 2048), "2", "2", "9000")


def test_a_missing_binary_names_the_build_command(tmp_path):
    with pytest.raises(LlamaCppPeerError, match="pagedllm bench llama-cpp build"):
        server_command(tmp_path, Path("m.gguf"), 9000, 1, 128, 1)


def test_each_slot_holds_the_longest_request_rounded_up_within_the_model():
    requests = [BenchRequest([1] * 100, 300), BenchRequest([1] * 10, 20)]
    assert llama_cpp_peer.slot_context(requests, max_model_len=8192) == 512
    assert llama_cpp_peer.slot_context(requests, max_model_len=384) == 384


def test_completion_payload_forces_the_planned_length_from_token_ids():
    payload = completion_payload(BenchRequest([5, 6, 7], 9), temperature=0.7, seed=3)
    assert (payload["prompt"], payload["n_predict"], payload["ignore_eos"]) == ([5, 6, 7], 9, True)
    assert (payload["temperature"], payload["seed"], payload["top_k"], payload["min_p"]) == (0.7, 3, 0, 0.0)
    assert payload["cache_prompt"] is False and payload["stream"] is False


def test_completion_answers_are_counted_and_short_or_error_answers_raise():
    request = BenchRequest([1, 2], 4)
    assert parse_completion({"content": "abcd", "tokens_predicted": 4, "stop_type": "limit"}, request) == 4
    with pytest.raises(LlamaCppPeerError, match=r"generated 3 tokens where 4 were asked \(stop: eos\)"):
        parse_completion({"tokens_predicted": 3, "stop_type": "eos"}, request)
    with pytest.raises(LlamaCppPeerError, match="refused a request: the request exceeds the context"):
        parse_completion({"error": {"code": 400, "message": "the request exceeds the context"}}, request)


def test_every_request_reaches_the_server_and_its_tokens_are_counted(fake_build, tmp_path, monkeypatch):
    log = tmp_path / "server.jsonl"
    monkeypatch.setenv("FAKE_LOG", str(log))
    requests = [BenchRequest([10 + i] * (i + 1), 3 + i) for i in range(6)]
    result = run_llama_server(fake_build, Path("m.gguf"), requests, 1.0, seed=5, max_model_len=512,
                              parallel=4, threads=2, port=_free_port(), log_path=tmp_path / "llama-server.log")
    assert result["output_tokens"] == sum(r.output_len for r in requests)
    assert (result["parallel"], result["threads"]) == (4, 2) and result["peak_rss_gib"] > 0
    argv, bodies = _logged(log)
    assert argv[argv.index("-np") + 1] == "4" and argv[argv.index("-c") + 1] == str(4 * 256)  # 4 slots of the longest
    sent = sorted((b["prompt"], b["n_predict"], b["seed"]) for b in bodies)
    assert sent == sorted((r.prompt_token_ids, r.output_len, 5 + i) for i, r in enumerate(requests))


def test_a_short_answer_fails_the_run(fake_build, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "server.jsonl"))
    monkeypatch.setenv("FAKE_SHORT", "1")
    with pytest.raises(LlamaCppPeerError, match="generated 2 tokens where 3 were asked"):
        run_llama_server(fake_build, Path("m.gguf"), [BenchRequest([1], 3)], 1.0, 0, 64, port=_free_port(),
                         log_path=tmp_path / "llama-server.log")


def test_a_server_that_exits_at_start_raises_with_its_log(tmp_path):
    binaries = tmp_path / "bin"
    binaries.mkdir()
    (binaries / "llama-server").write_text("#!/bin/sh\necho 'error: failed to load model m.gguf'\nexit 1\n")
    (binaries / "llama-server").chmod(0o755)
    with pytest.raises(LlamaCppPeerError, match=r"(?s)exited \(1\) before serving.*failed to load model"):
        run_llama_server(binaries, Path("m.gguf"), [BenchRequest([1], 1)], 1.0, 0, 64, port=_free_port(),
                         log_path=tmp_path / "llama-server.log")


def test_throughput_reports_llama_cpp_on_the_default_gguf(fake_build, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "server.jsonl"))
    out = tmp_path / "throughput.json"
    args = ["bench", "throughput", "--backend", "llama-cpp", "--dataset", "alpaca", "--num-prompts", "3",
            "--llama-cpp-dir", str(fake_build.parent.parent), "--llama-cpp-parallel", "2", "--output-json", str(out)]
    assert main(args) == 0
    (row,) = json.loads(out.read_text())["results"]
    argv, bodies = _logged(tmp_path / "server.jsonl")
    from pagedllm.transformers_utils import resolve_model

    assert argv[argv.index("-m") + 1] == str(resolve_model(None).path)  # the engine's own file
    assert row["backend"] == "llama-cpp" and row["output_tokens"] == sum(b["n_predict"] for b in bodies)
    assert len(bodies) == 3 and row["output_tok_per_s"] == pytest.approx(row["output_tokens"] / row["elapsed_s"])


def test_llama_cpp_refuses_a_transformers_folder(tiny_llama):
    with pytest.raises(LlamaCppPeerError, match="runs GGUF files"):
        llama_cpp_peer.gguf_file(str(tiny_llama))


def test_build_configures_natively_then_builds_the_four_tools(tmp_path, monkeypatch):
    source = llama_cpp_peer.source_dir(tmp_path)
    source.mkdir(parents=True)
    (source / "CMakeLists.txt").write_text("")
    commands = []

    def fake_run(command, **kwargs):
        commands.append(command)
        if "--build" in command:
            (tmp_path / "build" / "bin").mkdir(parents=True)
            for name in llama_cpp_peer.TARGETS:
                (tmp_path / "build" / "bin" / name).write_text("")
        return type("Done", (), {"returncode": 0, "stdout": "", "stderr": ""})()

    monkeypatch.setattr(llama_cpp_peer.subprocess, "run", fake_run)
    assert ensure_llama_cpp(tmp_path, jobs=2, log=lambda _: None) == tmp_path / "build" / "bin"
    configure, build = commands
    assert {"-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"} <= set(configure)
    assert build[build.index("--target") + 1 :] == ["llama-server", "llama-quantize", "llama-bench", "llama-perplexity"]
    assert "-j2" in build
    assert ensure_llama_cpp(tmp_path, log=lambda _: None) and len(commands) == 2  # built once


def test_x86_builds_leave_amx_out():
    x86 = llama_cpp_peer.configure_command(Path("src"), Path("build"), machine="x86_64")
    assert "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in x86 and "-DGGML_NATIVE=ON" in x86
    assert not any("amx" in word for word in llama_cpp_peer.configure_command(Path("src"), Path("build"), machine="aarch64"))


def test_a_failed_build_step_raises_with_its_output(tmp_path, monkeypatch):
    source = llama_cpp_peer.source_dir(tmp_path)
    source.mkdir(parents=True)
    (source / "CMakeLists.txt").write_text("")
    monkeypatch.setattr(llama_cpp_peer.subprocess, "run",
                        lambda command, **kw: type("Done", (), {"returncode": 1, "stdout": "", "stderr": "CMake Error: no compiler"})())
    with pytest.raises(LlamaCppPeerError, match="(?s)cmake -S .* failed.*no compiler"):
        ensure_llama_cpp(tmp_path, log=lambda _: None)
    assert not (tmp_path / llama_cpp_peer._STAMP).exists()


# --- bench spec --llama-cpp ------------------------------------------------------------------

def test_the_ngram_server_has_one_slot_and_the_speculation_flags(fake_build):
    command = server_command(fake_build, Path("m.gguf"), 9000, parallel=1, slot_context=1024, threads=3,
                             extra_args=ngram_simple_args(lookup=4, draft=16))
    flags = {a: b for a, b in zip(command, command[1:]) if a.startswith("-")}
    assert (flags["-np"], flags["-c"], flags["-t"]) == ("1", "1024", "3")
    assert (flags["--spec-type"], flags["--spec-ngram-simple-size-n"], flags["--spec-ngram-simple-size-m"]) == ("ngram-simple", "4", "16")
    assert "--spec-type" not in server_command(fake_build, Path("m.gguf"), 9000, 1, 1024, 3)


def test_greedy_payload_asks_for_the_tokens_and_exact_length():
    payload = greedy_payload(BenchRequest([5, 6, 7], 9), cache_prompt=True)
    assert (payload["prompt"], payload["n_predict"], payload["ignore_eos"], payload["temperature"]) == ([5, 6, 7], 9, True, 0.0)
    assert payload["return_tokens"] is True and payload["cache_prompt"] is True
    assert greedy_payload(BenchRequest([5], 1), cache_prompt=False)["cache_prompt"] is False


def test_a_greedy_answer_gives_its_tokens_and_draft_counts():
    request = BenchRequest([1, 2], 3)
    answer = {"tokens": [4, 5, 6], "tokens_predicted": 3, "timings": {"draft_n": 10, "draft_n_accepted": 7}}
    assert parse_greedy_completion(answer, request) == {"tokens": [4, 5, 6], "draft_tokens": 10, "accepted_tokens": 7}
    plain = parse_greedy_completion({"tokens": [4, 5, 6], "tokens_predicted": 3, "timings": {}}, request)
    assert (plain["draft_tokens"], plain["accepted_tokens"]) == (0, 0)
    with pytest.raises(LlamaCppPeerError, match="generated 2 tokens where 3 were asked"):
        parse_greedy_completion({"tokens": [4, 5], "tokens_predicted": 2}, request)


def test_a_missing_build_names_the_build_command_and_never_builds(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_cpp_peer.subprocess, "run", lambda *a, **kw: pytest.fail("built"))
    with pytest.raises(LlamaCppPeerError, match=re.escape(f"`pagedllm bench llama-cpp build --dir {tmp_path}`")):
        built_binaries(tmp_path)


def test_bench_spec_without_a_build_fails_before_loading_a_model(tmp_path, capsys):
    assert main(["bench", "spec", "--llama-cpp", "--llama-cpp-dir", str(tmp_path / "none"),
                 "--output-json", str(tmp_path / "spec.json")]) == 1
    assert "pagedllm bench llama-cpp build" in capsys.readouterr().out
    assert not (tmp_path / "spec.json").exists()


def _servers(log: Path) -> list[tuple[list[str], list[dict]]]:
    """Each fake server's arguments and the requests it was sent, in the order they ran."""
    servers = []
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        if "argv" in entry:
            servers.append((entry["argv"], []))
        else:
            servers[-1][1].append(entry)
    return servers


def test_bench_spec_reports_llama_cpp_plain_and_ngram_beside_the_engine(fake_build, tiny_llama, tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "server.jsonl"))
    monkeypatch.setattr(llama_cpp_peer, "gguf_file", lambda model: Path("tiny.gguf"))  # the fake loads nothing
    out = tmp_path / "spec.json"
    threads = torch.get_num_threads()
    assert main(["bench", "spec", str(tiny_llama), "--max-model-len", "512", "--num-gpu-blocks", "128",
                 "--sets", "chat", "--max-tokens", "4", "--num-iters", "1", "--llama-cpp",
                 "--llama-cpp-dir", str(fake_build.parent.parent), "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())["results"]
    (plain_server, plain_bodies), (ngram_server, ngram_bodies) = _servers(tmp_path / "server.jsonl")
    for argv in (plain_server, ngram_server):
        assert (argv[argv.index("-np") + 1], argv[argv.index("-t") + 1], argv[argv.index("-m") + 1]) == ("1", str(threads), "tiny.gguf")
    assert "--spec-type" not in plain_server
    assert ngram_server[ngram_server.index("--spec-type") + 1] == "ngram-simple"
    assert ngram_server[ngram_server.index("--spec-ngram-simple-size-m") + 1] == "16"  # num_speculative_tokens
    assert ngram_server[ngram_server.index("--spec-ngram-simple-size-n") + 1] == "4"  # prompt_lookup_max
    rows = result["prompts"]
    for bodies in (plain_bodies, ngram_bodies):  # a warm-up, then each prompt for pagedllm's length
        assert [(len(b["prompt"]), b["n_predict"]) for b in bodies[1:]] == [(r["prompt_tokens"], r["output_tokens"]) for r in rows]
        assert all(b["temperature"] == 0.0 and b["ignore_eos"] for b in bodies)
    for row in rows:
        assert row["llama_accept_rate"] == 0.5  # as the fake reports
        assert row["spec_vs_llama_spec"] == pytest.approx(row["spec_tok_s"] / row["llama_spec_tok_s"])
    (summary,) = result["summary"]
    tokens = sum(r["output_tokens"] for r in rows)
    assert summary["llama_spec_tok_s"] == pytest.approx(tokens / sum(r["output_tokens"] / r["llama_spec_tok_s"] for r in rows))
    assert summary["spec_vs_llama_spec"] == pytest.approx(summary["spec_tok_s"] / summary["llama_spec_tok_s"])
    assert summary["plain_vs_llama"] == pytest.approx(summary["plain_tok_s"] / summary["llama_tok_s"])


def test_a_summary_without_llama_cpp_keeps_the_engine_columns_alone():
    from pagedllm.bench.spec import _summary

    rows = [{"output_tokens": 10, "plain_tok_s": 10.0, "spec_tok_s": 20.0, "speedup": 2.0},
            {"output_tokens": 30, "plain_tok_s": 30.0, "spec_tok_s": 30.0, "speedup": 1.0}]
    summary = _summary("chat", rows)
    assert list(summary) == ["set", "prompts", "output_tokens", "plain_tok_s", "spec_tok_s", "speedup", "min_speedup"]
    assert (summary["plain_tok_s"], summary["spec_tok_s"], summary["speedup"]) == (20.0, pytest.approx(80 / 3), pytest.approx(4 / 3))
