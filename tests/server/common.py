"""Settings and helpers shared by the server tests: the served model's flags and probes of /stats and /metrics."""

from __future__ import annotations

import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny"
MAX_MODEL_LEN = 256
SERVE_FLAGS = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "64MiB", "--swap-space", "0.01",
               "--served-model-name", MODEL, "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
               "--max-body-bytes", "1MiB"]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


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
