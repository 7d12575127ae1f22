"""A hostile soak (issue 51): one server driven for 60 s (`--soak`: 30 min; `--soak-seconds` to
choose) by a steady, seeded random mix of normal clients and hostile ones (hostile_traffic.py).
No request may crash a step, starve the others or get silently wrong data:

- every hostile request gets its expected answer (a 400 naming the field or the limit, a 413, or
  a 200 of the right shape), never a 5xx or a dropped connection;
- every normal request gets a 200 whose texts are exactly those the same request got alone
  before the load (the server runs batch-invariant, so under any load they must match bitwise);
- /health answers 200 every second;
- the server's resident memory after the load is at most what it held after the warm-up plus
  the budgets that grow with what clients send (the compiled-grammar cache's bytes, and the
  prompt-logprob pieces' working set; the KV cache is allocated at start) plus ALLOWANCE_BYTES.

The warm-up builds the grammar compiler and serves each kind once, so the memory at start has
every lazily built table, thread and allocator arena of every path behind it. Both the start and
the end are measured just after the server handed its freed heap back to the system
(`_hand_back_heap`); the end before that ("drained") and the peak are reported too.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from dataclasses import dataclass

import httpx
import psutil

from pagedllm.worker.model_runner import PROMPT_LOGPROBS_BYTES
from tests.reliability.common import BODY_IDLE_TIMEOUT_S, serving
from tests.reliability.hostile_traffic import MAX_BODY_BYTES, MAX_SEQS_PER_REQUEST, Answer, Mix, Request, choice_texts
from tests.server.common import stats, wait_until

RATE = 4.0  # requests per second, half of them hostile
SEED = 51
MIB = 1 << 20
GRAMMAR_CACHE_BYTES = 64 * MIB
FLAGS = [
    "--batch-invariant",  # a request's tokens never depend on its neighbours: wrong data shows as a difference
    "--structured-outputs-cache-bytes", str(GRAMMAR_CACHE_BYTES),
    "--max-body-bytes", str(MAX_BODY_BYTES),
    "--max-seqs-per-request", str(MAX_SEQS_PER_REQUEST),
    "--body-idle-timeout", str(BODY_IDLE_TIMEOUT_S),
]
# What the server may hold at the end beyond the grammar cache. Measured here (2-core EPYC), with
# the heap handed back at both ends: normal traffic alone grew the server by 13 MiB over 240 s at
# 6 requests/s, and the whole mix without heavy grammars by 24 MiB over 60 s after a longer
# warm-up, levelling off: thread arenas, pymalloc pools and the tokenizers' caches filled by new
# shapes and more concurrency than the warm-up's one request at a time.
ALLOWANCE_BYTES = 32 * MIB
# The other budget whose bytes the traffic fills: prompt logprobs are computed PROMPT_LOGPROBS_BYTES
# of logits at a time, with their log-softmax as much again. The allocator keeps that working set's
# high water: a server sent only prompt-logprob requests (1 a second, heap handed back before
# each reading) rose 699, 706, 770 MiB in its first 2 minutes, then 772-778 over the next 4.
PROMPT_LOGPROBS_WORKING_BYTES = 2 * PROMPT_LOGPROBS_BYTES


@dataclass
class Outcome:
    kind: str
    status: str  # the HTTP status, "hung up" or "dropped"
    problem: str | None
    sent_at: float = 0.0  # seconds into the soak


def _json(response: httpx.Response) -> dict | None:
    try:
        return response.json()
    except ValueError:
        return None


async def _send(http: httpx.AsyncClient, request: Request) -> Answer:
    sent = {"json": request.body} if isinstance(request.body, dict) else {
        "content": request.body, "headers": {"content-type": "application/json"}}
    if request.hang_up_after_seconds is not None:
        try:
            response = await asyncio.wait_for(http.post(request.route, **sent), request.hang_up_after_seconds)
        except asyncio.TimeoutError:
            return Answer(None)
        return Answer(response.status_code, _json(response))
    if not request.stream:
        response = await http.post(request.route, **sent)
        return Answer(response.status_code, _json(response))
    async with http.stream("POST", request.route, **sent) as response:
        if response.status_code != 200:
            await response.aread()
            return Answer(response.status_code, _json(response))
        answer = Answer(200)
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                answer.done = True
            elif line.startswith("data: "):
                answer.events.append(json.loads(line[len("data: "):]))
                if request.hang_up_after_events is not None and len(answer.events) >= request.hang_up_after_events:
                    return Answer(None, events=answer.events)
        return answer


async def _one(http: httpx.AsyncClient, request: Request) -> Outcome:
    try:
        answer = await _send(http, request)
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: an event that is not JSON
        return Outcome(request.kind, "dropped", repr(exc))
    status = "hung up" if answer.status is None else str(answer.status)
    if request.status is None:  # a client that hangs up: whatever came before must not be an error
        ok = answer.status in (None, 200)
        return Outcome(request.kind, status, None if ok else f"{answer.status} {str(answer.body)[:300]}")
    expected = request.status if isinstance(request.status, tuple) else (request.status,)
    if answer.status not in expected:
        return Outcome(request.kind, status, f"{answer.status}, not {request.status}: {str(answer.body)[:300]}")
    return Outcome(request.kind, status, request.check(answer) if request.check else None)


def _client(url: str) -> httpx.AsyncClient:
    # Idle connections are dropped after 2 s, before the server's keep-alive timeout (uvicorn's
    # 5 s) does: else a request sent on a connection the server is closing at that moment is lost.
    limits = httpx.Limits(max_connections=200, keepalive_expiry=2.0)
    return httpx.AsyncClient(base_url=url, timeout=180, limits=limits)


async def _warm_up(url: str, mix: Mix) -> list[Outcome]:
    """Each normal request alone (its texts become the reference), then one of each kind, the
    last of which hands the freed heap back (as `_hand_back_heap`)."""
    async with _client(url) as http:
        for key, request in mix.reference_requests():
            answer = await _send(http, request)
            assert answer.status == 200 and request.check(answer) is None, (key, answer)
            mix.references[key] = choice_texts(request.route, answer)
        return [await _one(http, request) for request in mix.one_of_each()]


async def _hand_back_heap(url: str, mix: Mix) -> Outcome:
    """Make the server give its freed heap back to the system: a grammar over the cache budget
    is refused once compiled, and the cache then calls malloc_trim. glibc keeps freed memory in
    its arenas otherwise (every thread's), and a resident set measured without this counts
    whatever the allocator happens to keep on its free lists at that moment."""
    async with _client(url) as http:
        return await _one(http, mix.grammar_over_budget())


async def _soak(url: str, pid: int, mix: Mix, seconds: float) -> tuple[list[Outcome], list[int], list[str]]:
    """(each request's outcome, the server's RSS every second, /health problems)."""
    server = psutil.Process(pid)
    rss: list[int] = []
    health: list[str] = []
    done = asyncio.Event()

    async def sampler(http: httpx.AsyncClient) -> None:
        while not done.is_set():
            rss.append(server.memory_info().rss)
            try:
                status = (await http.get("/health", timeout=10)).status_code
                if status != 200:
                    health.append(f"/health {status} at {len(rss)} s")
            except httpx.HTTPError as exc:
                health.append(f"/health {exc!r} at {len(rss)} s")
            try:
                await asyncio.wait_for(done.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    async with _client(url) as http:
        watcher = asyncio.ensure_future(sampler(http))
        start = time.monotonic()
        requests = []
        while time.monotonic() - start < seconds:
            requests.append(asyncio.ensure_future(_sent_at(_one(http, mix.next()), time.monotonic() - start)))
            await asyncio.sleep(max(0.0, start + len(requests) / RATE - time.monotonic()))  # a steady rate
        outcomes = await asyncio.gather(*requests)
        done.set()
        await watcher
    return list(outcomes), rss, health


async def _sent_at(outcome, seconds: float) -> Outcome:
    done = await outcome
    done.sent_at = seconds
    return done


def _problems(outcomes: list[Outcome]) -> str:
    """The unexpected answers by kind: how many, when, and the first few in full."""
    by_kind: dict[str, list[Outcome]] = collections.defaultdict(list)
    for outcome in outcomes:
        if outcome.problem:
            by_kind[outcome.kind].append(outcome)
    return "\n".join(
        f"{kind}: {len(found)}, sent at {', '.join(f'{o.sent_at:.0f}' for o in found[:20])} s: "
        + " | ".join(o.problem for o in found[:3])
        for kind, found in by_kind.items()
    )


def _idle(url: str) -> bool:
    s = stats(url)
    return s["num_running"] == s["num_waiting"] == s["num_swapped"] == 0


def test_hostile_traffic_neither_crashes_starves_nor_corrupts(tiny_llama, soak_seconds, figures):
    mix = Mix(SEED)
    with serving(tiny_llama, *FLAGS) as server:
        process = psutil.Process(server.pid)
        warm = asyncio.run(_warm_up(server.url, mix))
        assert not any(o.problem for o in warm), _problems(warm)
        wait_until(lambda: _idle(server.url), timeout=60)
        rss_start = process.memory_info().rss

        begin = time.monotonic()
        outcomes, rss, health = asyncio.run(_soak(server.url, server.pid, mix, soak_seconds))
        elapsed = time.monotonic() - begin
        wait_until(lambda: _idle(server.url), timeout=60)
        rss_drained = process.memory_info().rss
        handed_back = asyncio.run(_hand_back_heap(server.url, mix))
        rss_end = process.memory_info().rss
        end = stats(server.url)
        log = "".join(server.log)

    problems = [o for o in outcomes + [handed_back] if o.problem]
    server_errors = [o for o in outcomes if o.status.startswith("5") or o.status == "dropped"]
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for o in outcomes:
        by_kind[o.kind][o.status] += 1
    normal = sum(sum(by_kind[k].values()) for k in mix.normal_kinds)
    rss_peak = max(rss + [rss_start, rss_drained, rss_end])
    bound = rss_start + GRAMMAR_CACHE_BYTES + PROMPT_LOGPROBS_WORKING_BYTES + ALLOWANCE_BYTES
    kinds = "; ".join(f"{kind} " + " ".join(f"{status}x{count}" for status, count in sorted(by_kind[kind].items()))
                      for kind, _, _ in mix.kinds if kind in by_kind)
    figures(
        "hostile soak",
        f"{soak_seconds:.0f} s at {RATE:g} requests/s (seed {SEED}; {elapsed:.0f} s with the last answers): "
        f"{len(outcomes)} requests ({normal} normal, {len(outcomes) - normal} hostile), {len(problems)} unexpected, "
        f"{len(server_errors)} 5xx or dropped, /health {len(rss) - len(health)}/{len(rss)} 200; RSS start "
        f"{rss_start / MIB:.0f}, peak {rss_peak / MIB:.0f}, drained {rss_drained / MIB:.0f}, end {rss_end / MIB:.0f} MiB "
        f"(end - start {(rss_end - rss_start) / MIB:+.0f} MiB; bound +{GRAMMAR_CACHE_BYTES / MIB:.0f} grammar cache "
        f"+{PROMPT_LOGPROBS_WORKING_BYTES / MIB:.0f} prompt logprobs +{ALLOWANCE_BYTES / MIB:.0f}); by kind: {kinds}",
    )
    assert problems == [], _problems(problems)
    assert health == [], health[:10]
    assert "Traceback" not in log, log[log.index("Traceback") - 2000:][:6000]
    assert end["num_free_blocks"] == end["num_total_blocks"] and end["healthy"]
    assert rss_end <= bound, "RSS (MiB) every 10 s: " + ", ".join(f"{r / MIB:.0f}" for r in rss[::10])
