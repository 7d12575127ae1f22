"""The OpenAI-compatible server, started for real on a free loopback port (in a thread, once for
the session) and the clients that drive it: the official `openai` client (sync and async)."""

from __future__ import annotations

import openai
import pytest

from pagedllm.cli import build_parser
from tests.server.common import SERVE_FLAGS, start_server_thread


@pytest.fixture(scope="session")
def server_url(tiny_llama):
    args = build_parser().parse_args(["serve", str(tiny_llama), "--port", "0", *SERVE_FLAGS])
    server, thread, url = start_server_thread(args)
    yield url
    server.should_exit = True
    thread.join(30)


@pytest.fixture(scope="session")
def long_context_url(tiny_llama):
    """The tiny model's server with a 1024-token context: room for tools' descriptions in the
    prompt (structured outputs, Responses, the Agents SDK share it)."""
    args = build_parser().parse_args(["serve", str(tiny_llama), "--port", "0", *SERVE_FLAGS, "--max-model-len", "1024"])
    server, thread, url = start_server_thread(args)
    yield url
    server.should_exit = True
    thread.join(30)


@pytest.fixture(scope="session")
def client(server_url):
    return openai.OpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def async_client(server_url):
    return lambda: openai.AsyncOpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama))
