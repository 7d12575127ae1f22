"""The `pagedllm serve` command, run as a subprocess, starts a server whose /v1 routes require the --api-key."""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from tests.server.common import MODEL, SERVE_FLAGS


def test_pagedllm_serve_command_requires_the_api_key(tiny_llama):
    command = [sys.executable, "-m", "pagedllm.cli", "serve", str(tiny_llama), "--port", "0",
               "--api-key", "s3cret", *SERVE_FLAGS[:-2], "--uvicorn-log-level", "info"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in process.stderr:
            match = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
            if match:
                port = int(match.group(1))
                break
        assert port, "the server did not start"
        url = f"http://127.0.0.1:{port}"
        threading.Thread(target=process.stderr.read, daemon=True).start()  # keep the pipe drained
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        response = httpx.post(url + "/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/health").status_code == 200  # only /v1 is guarded, as in vLLM
        api = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert api.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    finally:
        process.terminate()
        process.wait(30)
