"""Settings and helpers shared by the server tests: the served model's flags and probes of /stats and /metrics."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny"
MAX_MODEL_LEN = 256
# Float32 activations (--int8-activations off): servers' outputs are compared with transformers'.
SERVE_FLAGS = ["--int8-activations", "off",
               "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "64MiB", "--swap-space", "0.01",
               "--served-model-name", MODEL, "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
               "--max-body-bytes", "1MiB"]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def start_server_process(
    model: Path, *flags: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str, list[str], threading.Thread]:
    """`pagedllm serve` in a process of its own on a free port, with SERVE_FLAGS and then `flags`
    (a later flag wins), and `env` added to the environment: (the process, its URL, its log
    lines after start-up, the thread collecting them)."""
    command = [sys.executable, "-m", "pagedllm.cli", "serve", str(model), "--port", "0", *SERVE_FLAGS,
               "--uvicorn-log-level", "info", *flags]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    early: list[str] = []
    for line in process.stderr:
        early.append(line)
        match = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
        if match:
            log: list[str] = []
            reader = threading.Thread(target=lambda: log.extend(process.stderr), daemon=True)
            reader.start()
            return process, f"http://127.0.0.1:{match.group(1)}", log, reader
    raise AssertionError("the server did not start:\n" + "".join(early[-40:]))


def start_server_thread(args, engine=None):
    """`pagedllm serve`'s server for parsed `args` (and `engine`, if given), run on a thread of
    this process: (the uvicorn server, its thread, its URL). `server.should_exit = True` stops it."""
    from pagedllm.entrypoints.openai.api_server import create_server

    server = create_server(args, engine)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}"


def raw_json(body: dict) -> dict:
    """Request arguments that send `body` as Python's json writes it, NaN, Infinity and lone
    surrogates (as \\ud800 escapes) included: what a careless or hostile client may send, and what
    httpx's own `json=` refuses to encode."""
    return {"content": json.dumps(body), "headers": {"content-type": "application/json"}}


def stats(server_url: str) -> dict:
    return httpx.get(server_url + "/stats").json()


def metric_samples(server_url: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels without model_name) -> value, parsed by prometheus_client."""
    text = httpx.get(server_url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def streamed_completion(client, **kwargs) -> tuple[dict[int, str], dict[int, str], dict | None]:
    """Texts and finish reasons by choice index, and the usage, of a streamed completion."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    return texts, reasons, usage
