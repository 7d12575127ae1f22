"""Under many concurrent streams each client gets its own greedy text, and disconnected clients abort and free every block."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.helpers import random_prompts
from tests.server.common import GREEDY, MODEL, metric_samples, stats, wait_until


def test_many_concurrent_streaming_clients_all_complete_with_their_own_text(client, async_client):
    prompts = random_prompts(40, [2, 5, 11, 23], seed=9)

    async def stream(api, prompt):
        text, usage = "", None
        response = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY)
        async for chunk in response:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def run_all():
        async with async_client() as api:
            return await asyncio.gather(*(stream(api, p) for p in prompts))

    results = asyncio.run(run_all())
    assert [n for _, n in results] == [12] * len(prompts)
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, **GREEDY).choices[0].text for p in prompts]
    assert [text for text, _ in results] == alone  # batching with others changes no greedy output


def test_disconnected_clients_abort_their_requests_and_free_all_blocks(client, server_url):
    aborted_before = metric_samples(server_url).get(("pagedllm:request_success_total", (("finished_reason", "abort"),)), 0)
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        streams = [http.stream("POST", server_url + "/v1/completions", json=body) for _ in range(8)]
        for ctx in streams:
            response = ctx.__enter__()
            next(line for line in response.iter_lines() if line.startswith("data: "))  # generating
        for ctx in streams:
            ctx.__exit__(None, None, None)
    # A non-streamed request whose client gives up waiting is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server_url + "/v1/completions", timeout=0.3,
                   json={**body, "stream": False, "n": 4, "temperature": 1.0})

    def all_free() -> bool:
        s = stats(server_url)
        return s["num_running"] == s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]

    wait_until(all_free)
    aborted = metric_samples(server_url)[("pagedllm:request_success_total", (("finished_reason", "abort"),))]
    assert aborted - aborted_before == 9
    assert client.completions.create(model=MODEL, prompt="still there?", max_tokens=3).choices[0].finish_reason
