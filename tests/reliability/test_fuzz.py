"""Schema fuzzing of every route in the server's own OpenAPI document (schemathesis), bounded in
time: no response is a 5xx, and none contradicts the document. The fuzzer (fuzz_client.py) runs
in a process of its own; its docstring says why.

The server fuzzed takes at most 8 sequences of 64 tokens: generated values such as `n=200` or
`max_tokens=250` are then refused at once instead of costing seconds each, and the time goes to
trying more inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reliability.common import serving


@pytest.fixture(scope="module")
def fuzzed_url(tiny_llama):
    with serving(tiny_llama, "--max-num-seqs", "8", "--max-model-len", "64") as server:
        yield server.url


def test_fuzzing_every_route_finds_no_server_error_and_no_schema_violation(fuzzed_url, long_form, figures):
    pytest.importorskip("schemathesis")
    budget_s = 600.0 if long_form else 20.0
    command = [sys.executable, "-m", "tests.reliability.fuzz_client", fuzzed_url, str(budget_s)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=budget_s + 300,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    statuses = found["statuses"]
    figures(
        "fuzz",
        f"{len(found['routes'])} routes, {sum(found['cases'].values())} cases ({found['by_mode'].get('positive', 0)} "
        f"schema-valid, {found['by_mode'].get('negative', 0)} schema-violating) in {found['seconds']:.0f} s; responses "
        f"{', '.join(f'{k} {v}' for k, v in sorted(statuses.items()))}; 5xx {statuses.get('5xx', 0)}, schema violations "
        f"{len(found['violations'])}; schema-valid requests refused with a documented 400: {found['refused_valid']}",
    )
    assert set(found["cases"]) == set(found["routes"]), "a route was never fuzzed"
    # Every route that streams streamed once, each event checked against the document (OpenAI's,
    # llama-server's, Anthropic's and the Responses events alike).
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/messages",
            "POST /v1/responses"} <= set(found["streamed"])
    assert statuses.get("5xx", 0) == 0 and not found["violations"], "\n".join(found["violations"][:20])
