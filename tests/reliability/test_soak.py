"""A soak: a steady rate of mixed requests (completions and chat, streamed and not, parallel
samples, beams, prefix-cache hits, clients that hang up mid-stream, tokenizing) against one
server for 60 s (`--soak`: 30 min; `--soak-seconds` to choose). No request may fail, and the
server must stay flat: memory, latency, CPU per request, blocks held, tasks and threads alive.

What "flat" means here, robust on a shared, noisy 2-core machine yet able to catch a leak:
- memory: the server's resident set grows by at most max(16 MiB, 2%) over the second half,
  when start-up and warm-up allocations (allocator arenas, caches, lazily built tables) are
  behind it. Over 30 minutes at 5 requests/s that bound is about 4 KiB per request, less than
  what a leaked request (its token ids, outputs, stream, task) holds; over 60 s it is about
  100 KiB per request: a coarse net, the long form is the fine one.
- CPU time per request (the server's own, so other processes' load does not count): at most
  1.5x from the second quarter to the last. A structure that grows with the requests served (a
  list scanned each step, a table never trimmed) makes every request cost more and shows here.
  A shared VM also has slow spells in which the same work takes more CPU time (32 -> 52 ms a
  request once on a 2-core Zen 5 VM, with nothing growing); the client (this process, whose
  work per request is fixed) slows down with it, so where the client's own CPU per request grew
  too, the bound grows by the same factor. A leak in the server does not slow the client.
- latency: the median of the last quarter at most 2x that of the second quarter, plus 100 ms.
  A coarser bound than CPU's because latency also measures the neighbours: on a shared 2-core
  machine another process's busy minute halves the server's share of the cores and doubles its
  latency, as a leak would. A leak keeps growing: over the long form it passes any such bound.
- blocks held and requests running: none once the load stops; tasks on the server's event loop
  and threads: back to what they were before the load.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import httpx
import psutil

from tests.server.common import MODEL, stats, wait_until

RATE = 5.0  # requests per second
MIB = 1 << 20
SHARED_PREFIX = list(range(1000, 1040))  # 40 tokens (two full blocks and more) many prompts start with


@dataclass
class Sample:
    t: float
    rss: int
    cpu_s: float
    client_cpu_s: float
    blocks_held: int
    running: int
    tasks: int
    threads: int


def _body(i: int) -> tuple[str, dict, int | None]:
    """The i-th request of the mix: (route, body, events after which the client hangs up)."""
    prompt = SHARED_PREFIX + [2000 + i % 50, 7, 8]
    greedy = {"model": MODEL, "temperature": 0, "ignore_eos": True}
    kind = i % 8
    if kind == 0:
        return "/v1/completions", {**greedy, "prompt": prompt, "max_tokens": 16}, None
    if kind == 1:
        return "/v1/completions", {**greedy, "prompt": prompt, "max_tokens": 24, "stream": True,
                                   "stream_options": {"include_usage": True}}, None
    if kind == 2:
        return "/v1/chat/completions", {**greedy, "messages": [{"role": "user", "content": f"Question {i}?"}], "max_tokens": 16}, None
    if kind == 3:  # hangs up mid-stream: the request is aborted
        return "/v1/completions", {**greedy, "prompt": prompt, "max_tokens": 200, "stream": True}, 3
    if kind == 4:
        return "/v1/completions", {"model": MODEL, "prompt": prompt, "n": 2, "temperature": 0.8, "seed": i, "max_tokens": 16}, None
    if kind == 5:
        return "/v1/completions", {**greedy, "prompt": prompt, "n": 2, "best_of": 2, "use_beam_search": True, "max_tokens": 8}, None
    if kind == 6:
        return "/v1/chat/completions", {**greedy, "messages": [{"role": "user", "content": f"Story {i}"}], "max_tokens": 16,
                                        "stream": True}, None
    return "/tokenize", {"model": MODEL, "prompt": f"How many tokens has request {i}?"}, None


async def _one(http: httpx.AsyncClient, i: int) -> tuple[float, float, str | None]:
    """(start, seconds, error or None) of the i-th request."""
    route, body, hang_up_after = _body(i)
    begin = time.monotonic()
    try:
        if not body.get("stream"):
            response = await http.post(route, json=body)
            error = None if response.status_code == 200 else f"{route} {response.status_code} {response.text[:200]}"
            return begin, time.monotonic() - begin, error
        events = []
        async with http.stream("POST", route, json=body) as response:
            if response.status_code != 200:
                return begin, time.monotonic() - begin, f"{route} {response.status_code}"
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if hang_up_after is not None and len(events) >= hang_up_after:
                        return begin, time.monotonic() - begin, None
        if not events or events[-1] != "[DONE]" or any("error" in json.loads(e) for e in events[:-1]):
            return begin, time.monotonic() - begin, f"{route} stream: {events[-2:]}"
        return begin, time.monotonic() - begin, None
    except httpx.HTTPError as exc:
        return begin, time.monotonic() - begin, f"{route} {exc!r}"


async def _soak(url: str, pid: int, seconds: float, sample_every: float) -> tuple[list, list[Sample]]:
    server = psutil.Process(pid)
    samples: list[Sample] = []
    start = time.monotonic()
    done = asyncio.Event()

    async def sampler(http: httpx.AsyncClient) -> None:
        while not done.is_set():
            s = (await http.get("/stats")).json()
            cpu = server.cpu_times()
            samples.append(Sample(time.monotonic() - start, server.memory_info().rss, cpu.user + cpu.system, time.process_time(),
                                  s["num_total_blocks"] - s["num_free_blocks"], s["num_running"], s["num_tasks"], s["num_threads"]))
            try:
                await asyncio.wait_for(done.wait(), sample_every)
            except asyncio.TimeoutError:
                pass

    # Idle connections are dropped after 2 s, before the server's keep-alive timeout (uvicorn's
    # 5 s) does: else a request sent on a connection the server is closing at that moment is lost.
    limits = httpx.Limits(max_connections=200, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        watcher = asyncio.ensure_future(sampler(http))
        requests = []
        i = 0
        while time.monotonic() - start < seconds:
            requests.append(asyncio.ensure_future(_one(http, i)))
            i += 1
            await asyncio.sleep(max(0.0, start + i / RATE - time.monotonic()))  # a steady rate, whatever the latency
        results = await asyncio.gather(*requests)
        done.set()
        await watcher
    return [(begin - start, seconds_, error) for begin, seconds_, error in results], samples


def _quarter(t: float, seconds: float) -> int:
    return min(3, int(4 * t / seconds))


def test_a_steady_load_leaves_the_server_flat(served, soak_seconds, figures):
    url = served.url
    server = psutil.Process(served.pid)

    def idle() -> bool:
        s = stats(url)
        return s["num_running"] == s["num_waiting"] == s["num_swapped"] == 0

    # Warm up (every kind of request once, twice), then take the idle baseline.
    asyncio.run(_soak(url, served.pid, 16 / RATE, sample_every=60))
    wait_until(idle, timeout=60)
    baseline = stats(url)

    results, samples = asyncio.run(_soak(url, served.pid, soak_seconds, sample_every=max(1.0, soak_seconds / 120)))
    wait_until(idle, timeout=60)
    end = stats(url)

    errors = [error for _, _, error in results if error]
    half = [s for s in samples if s.t <= soak_seconds / 2][-1]
    last = samples[-1]
    rss_growth = last.rss - half.rss
    rss_bound = max(16 * MIB, 0.02 * half.rss)
    latencies = {q: [sec for t, sec, err in results if _quarter(t, soak_seconds) == q and not err] for q in range(4)}
    p50 = {q: statistics.median(v) for q, v in latencies.items() if v}
    counts = {q: len(v) for q, v in latencies.items()}

    def per_request(field: str) -> dict[int, float]:
        def at(t: float) -> float:
            return getattr(min(samples, key=lambda s: abs(s.t - t)), field)
        return {q: (at((q + 1) * soak_seconds / 4) - at(q * soak_seconds / 4)) / max(1, counts[q]) for q in (1, 3)}

    cpu_per_request, client_per_request = per_request("cpu_s"), per_request("client_cpu_s")
    client_slowdown = max(1.0, client_per_request[3] / max(client_per_request[1], 1e-9))
    figures(
        "soak",
        f"{soak_seconds:.0f} s at {RATE:g} requests/s: {len(results)} requests, {len(errors)} errors; "
        f"RSS {half.rss / MIB:.0f} -> {last.rss / MIB:.0f} MiB over the second half ({rss_growth / MIB:+.1f} MiB, "
        f"bound {rss_bound / MIB:.0f}); p50 latency Q2 {p50[1] * 1e3:.0f} ms, Q4 {p50[3] * 1e3:.0f} ms; "
        f"server CPU per request Q2 {cpu_per_request[1] * 1e3:.0f} ms, Q4 {cpu_per_request[3] * 1e3:.0f} ms "
        f"(client's Q2 {client_per_request[1] * 1e3:.1f} ms, Q4 {client_per_request[3] * 1e3:.1f} ms); "
        f"blocks held peak {max(s.blocks_held for s in samples)}, after {end['num_total_blocks'] - end['num_free_blocks']}; "
        f"tasks {baseline['num_tasks']} -> {end['num_tasks']}, threads {baseline['num_threads']} -> {end['num_threads']} "
        f"(peak {max(s.tasks for s in samples)} tasks during the load)",
    )
    assert errors == [], errors[:5]
    assert rss_growth <= rss_bound, "RSS (MiB) over time: " + ", ".join(f"{s.t:.0f} s {s.rss / MIB:.0f}" for s in samples[::4])
    assert cpu_per_request[3] <= 1.5 * client_slowdown * cpu_per_request[1], (cpu_per_request, client_per_request)
    assert p50[3] <= 2 * p50[1] + 0.1
    assert end["num_free_blocks"] == end["num_total_blocks"] and end["num_free_cpu_blocks"] == end["num_cpu_blocks"]
    assert (end["num_tasks"], end["num_threads"]) == (baseline["num_tasks"], baseline["num_threads"])
    assert server.is_running()
