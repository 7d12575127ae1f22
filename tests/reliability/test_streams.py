"""Many streams at once, then clients that vanish mid-stream: no errors, every stream that runs
to its end ends with `data: [DONE]`, every vanished client's request is aborted, and every
block is free afterwards."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time

import httpx

from tests.helpers import random_prompts
from tests.server.common import MODEL, metric_samples, stats, wait_until

ABORTED = ("pagedllm:request_success_total", (("finished_reason", "abort"),))
# Clients drop idle connections after 2 s, before the server's keep-alive timeout (uvicorn's 5 s)
# does: else a request sent on a connection the server is closing at that moment is lost.
KEEPALIVE_S = 2.0


async def _stream(http: httpx.AsyncClient, route: str, body: dict, stop_after: int | None = None) -> dict:
    """One streamed request: its server-sent events' data, whether it ended with [DONE], its
    errors; with `stop_after`, the client hangs up after that many events."""
    begin = time.monotonic()
    events: list[str] = []
    async with http.stream("POST", route, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            return {"ok": False, "error": f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"}
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if stop_after is not None and len(events) >= stop_after:
                    return {"ok": True, "hung_up": True}
    errors = [e for e in events[:-1] if "error" in json.loads(e)]
    done = bool(events) and events[-1] == "[DONE]"
    usage = next((json.loads(e)["usage"] for e in reversed(events[:-1]) if json.loads(e).get("usage")), None)
    return {
        "ok": done and not errors,
        "error": errors[0] if errors else (None if done else "no [DONE]"),
        "completion_tokens": usage and usage["completion_tokens"],
        "seconds": time.monotonic() - begin,
    }


def _request(i: int, prompt: list[int], max_tokens: int) -> tuple[str, dict]:
    """Completions and chat in turn, greedy, a fixed number of tokens each."""
    common = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
              "stream_options": {"include_usage": True}}
    if i % 4 == 3:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"Tell me about {i}."}]}
    return "/v1/completions", {**common, "prompt": prompt}


async def _peak_running(url: str, stop: asyncio.Event) -> int:
    peak = 0
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S)) as http:
        while not stop.is_set():
            peak = max(peak, (await http.get("/stats")).json()["num_running_seqs"])
            await asyncio.sleep(0.1)
    return peak


def test_concurrent_streams_all_end_with_done_and_vanished_clients_free_every_block(served, long_form, figures):
    url = served.url
    num_streams, num_vanishing, num_alongside = (1024, 400, 80) if long_form else (256, 100, 20)
    max_tokens = 16
    prompts = random_prompts(num_streams, [3, 9, 17, 33, 60], seed=17)
    limits = httpx.Limits(max_connections=num_streams + num_vanishing + num_alongside + 8, keepalive_expiry=KEEPALIVE_S)
    aborted_before = metric_samples(url).get(ABORTED, 0)

    async def concurrent_streams():
        stop = asyncio.Event()
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
            peak = asyncio.ensure_future(_peak_running(url, stop))
            results = await asyncio.gather(*(_stream(http, *_request(i, p, max_tokens)) for i, p in enumerate(prompts)))
            stop.set()
            return results, await peak

    begin = time.monotonic()
    results, peak_running = asyncio.run(concurrent_streams())
    streams_s = time.monotonic() - begin
    failed = [r.get("error") for r in results if not r["ok"] or r["completion_tokens"] != max_tokens]

    async def vanishing_clients():
        rng = random.Random(5)
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
            vanishing = [_stream(http, "/v1/completions", body, stop_after=rng.randint(1, 6)) for _ in range(num_vanishing)]
            alongside = [_stream(http, *_request(i, p, max_tokens)) for i, p in enumerate(prompts[:num_alongside])]
            return await asyncio.gather(*vanishing, *alongside)

    outcomes = asyncio.run(vanishing_clients())
    hung_up = sum(1 for r in outcomes[:num_vanishing] if r.get("hung_up"))
    alongside_failed = [r.get("error") for r in outcomes[num_vanishing:] if not r["ok"] or r["completion_tokens"] != max_tokens]

    def idle_and_free() -> bool:
        s = stats(url)
        return s["num_running"] == s["num_waiting"] == s["num_swapped"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]

    wait_until(idle_and_free, timeout=60)
    end = stats(url)
    aborted = metric_samples(url)[ABORTED] - aborted_before
    latencies = [r["seconds"] for r in results if r["ok"]]
    figures(
        "streams",
        f"{num_streams} concurrent streams (peak {peak_running} sequences running) in {streams_s:.1f} s, "
        f"{num_streams - len(failed)} ended with [DONE] and {max_tokens} tokens, {len(failed)} errors, "
        f"p50 {statistics.median(latencies) if latencies else float('nan'):.1f} s; then {hung_up} clients hung up "
        f"mid-stream ({aborted:.0f} requests aborted) while {num_alongside - len(alongside_failed)}/{num_alongside} "
        f"others ended with [DONE]; blocks free after: {end['num_free_blocks']}/{end['num_total_blocks']}",
    )
    assert failed == [] and alongside_failed == [], (failed + alongside_failed)[:5]
    assert hung_up == num_vanishing and aborted == num_vanishing
    assert end["num_free_cpu_blocks"] == end["num_cpu_blocks"]
