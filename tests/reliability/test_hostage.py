"""No request holds the others hostage (issue 36). The default model is served with default
settings; a victim stream decodes while each hostile request of `hostage_cases` is sent, one at a
time. Each case records the victim's longest gap between two tokens while the hostile request
ran and the server's resident memory before, at its peak and after; one line of figures per
case. A case passes when the victim's longest gap stays within GAP_LIMIT_S, or when the request
was refused up front with a 400 naming the limit it is above (its message and `param`). A case
over the limit runs once more (a neighbour's burst on a shared machine can stall one step; a
hostage request stalls the victim every time), and its line says so.

Then many distinct heavy grammars (thousands of choices each, tens of MiB compiled): the
server's memory must stay within the compiled-grammar cache's byte budget plus 10% over what it
held before them (300 grammars under the default 256 MiB budget in the long form; a dozen under
a 64 MiB budget, on a server of its own, in the short form). And a grammar that runs past the
compile-time limit: its 400 names the limit, and the next grammar is served at once (the compile
thread is not left to the runaway).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil
import pytest

from pagedllm.transformers_utils.source import default_model_file
from tests.reliability.common import serving
from tests.server.common import MODEL as SERVED_MODEL
from tests.reliability.hostage_cases import CASES, MODEL, heavy_grammar, words

MIB = 1 << 20
GAP_LIMIT_S = 1.5
FLAGS = ["--served-model-name", MODEL, "--max-model-len", "4096", "--kv-cache-memory", "1GiB", "--max-body-bytes", "16MiB"]


@pytest.fixture(scope="module")
def hostage_server():
    with serving(default_model_file(), *FLAGS) as server:
        yield server


class Victim:
    """A greedy stream of many tokens, read on a thread; the time of each token's event."""

    def __init__(self, url: str) -> None:
        self.times: list[float] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self._thread.start()

    def _run(self, url: str) -> None:
        body = {"model": MODEL, "prompt": "The history of the world", "max_tokens": 3500, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
                if response.status_code != 200:
                    self.error = f"HTTP {response.status_code}"
                    return
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.times.append(time.monotonic())
                    if self._stop.is_set():
                        return
        except httpx.HTTPError as exc:
            self.error = repr(exc)

    def wait_tokens(self, count: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(self.times) < count:
            assert self.error is None and time.monotonic() < deadline, f"the victim stream did not start: {self.error}"
            time.sleep(0.02)

    def longest_gap(self, start: float, end: float) -> float:
        """The longest wait for a token between `start` and `end` (a wait still running at `end`
        counts up to `end`)."""
        times = [start] + [t for t in self.times if start < t <= end] + [end]
        return max(b - a for a, b in zip(times, times[1:]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


@dataclass
class Outcome:
    case: str
    status: int
    seconds: float
    gap: float
    rss_before: int
    rss_peak: int
    rss_after: int
    message: str = ""
    param: str | None = None
    problems: list[str] = field(default_factory=list)

    def line(self) -> str:
        answer = f"{self.status} in {self.seconds:.1f} s" + (f" (param {self.param})" if self.status != 200 else "")
        return (f"{self.case}: {answer}; victim's longest gap {self.gap:.2f} s; RSS {self.rss_before / MIB:.0f} -> peak "
                f"{self.rss_peak / MIB:.0f} -> {self.rss_after / MIB:.0f} MiB")


def _rss_sampler(pid: int, stop: threading.Event, peak: list[int]) -> None:
    process = psutil.Process(pid)
    while not stop.is_set():
        peak[0] = max(peak[0], process.memory_info().rss)
        time.sleep(0.1)


def run_case(server, name: str, body: dict, route: str = "/v1/completions") -> Outcome:
    process = psutil.Process(server.pid)
    victim = Victim(server.url)
    try:
        victim.wait_tokens(5)
        rss_before = process.memory_info().rss
        peak, stop = [rss_before], threading.Event()
        sampler = threading.Thread(target=_rss_sampler, args=(server.pid, stop, peak), daemon=True)
        sampler.start()
        start = time.monotonic()
        response = httpx.post(server.url + route, json=body, timeout=600)
        end = time.monotonic()
        stop.set()
        sampler.join(5)
        outcome = Outcome(name, response.status_code, end - start, victim.longest_gap(start, end), rss_before,
                          peak[0], process.memory_info().rss)
        if response.status_code != 200:
            error = response.json().get("error", {})
            outcome.message, outcome.param = error.get("message", ""), error.get("param")
        assert victim.error is None, f"the victim stream failed during {name}: {victim.error}"
        return outcome
    finally:
        victim.stop()


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_no_request_holds_the_victim_hostage(hostage_server, case, long_form, figures):
    if case.long_only and not long_form:
        pytest.skip("long form only (--soak)")
    body = case.body(long_form)
    outcome = run_case(hostage_server, case.name, body)
    if outcome.status == 200 and outcome.gap > GAP_LIMIT_S:
        # Once more: on a shared machine a neighbour's burst can stall one step; a hostage
        # request stalls the victim every time.
        first = outcome.gap
        outcome = run_case(hostage_server, case.name, body)
        outcome.case += f" (run twice: the first run's longest gap was {first:.2f} s)"
    figures("hostage", outcome.line())
    if case.refused_by is not None:
        assert outcome.status == 400, outcome.line()
        assert case.refused_by in outcome.message and outcome.param == case.param, (outcome.message, outcome.param)
        assert outcome.seconds < GAP_LIMIT_S
    else:  # served, or refused by a limit met on the way (a grammar's compile time or size)
        assert outcome.status == 200 or (outcome.status == 400 and "limit" in outcome.message), (
            outcome.line() + " " + outcome.message
        )
        assert outcome.gap <= GAP_LIMIT_S, outcome.line()


@pytest.mark.slow
def test_thousands_of_tools_in_auto_mode_hold_no_one(hostage_server, long_form, figures):
    """The grammar that keeps "auto" calls well-formed is built from the request's tools: for
    thousands of them, seconds (10,000 in Hermes' format: ~3 s; 3,000 in Mistral's: 6 s), which
    the server spent on its event loop, every other client waiting. Built on a worker thread, the
    victim streams on; the request is refused for its prompt (the tools' description) past the
    context."""
    count = 20_000 if long_form else 10_000
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "A tool.", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"]}}}
        for i in range(count)]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Call a tool."}], "tools": tools, "max_tokens": 8}
    outcome = run_case(hostage_server, f"{count:,} tools in auto mode", body, "/v1/chat/completions")
    figures("hostage", outcome.line())
    assert outcome.status == 400 and outcome.param == "messages" and "context" in outcome.message, outcome.message
    assert outcome.gap <= GAP_LIMIT_S, outcome.line()


@pytest.mark.slow
def test_a_request_of_many_prompts_does_not_hold_a_later_one_back(hostage_server, figures):
    """Issue 51 item 3: 1,000 prompts x n=16 in one request made a stream arriving 2 s later wait
    95 s for its first token. At the cap (16 prompts x n=16 = 256 sequences, every seat of
    max_num_seqs) decoding 16 tokens each, a stream sent a second later gets its first token
    within a few steps: the big request holds at most its share of the seats, and its waiting
    prompts take turns with the later request."""
    url = hostage_server.url
    big_body = {"model": MODEL, "prompt": ["Tell me a story about a dragon"] * 16, "n": 16, "temperature": 1.0, "seed": 5,
                "max_tokens": 16, "ignore_eos": True}
    big: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: big.append(httpx.post(url + "/v1/completions", json=big_body, timeout=600)))
    start = time.monotonic()
    sender.start()
    time.sleep(1.0)
    sent = time.monotonic()
    first_token = None
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and first_token is None:
                first_token = time.monotonic() - sent
    sender.join(600)
    figures("hostage", f"16 prompts x n=16 (256 sequences) decoding 16 tokens: {big[0].status_code} in "
                       f"{time.monotonic() - start:.1f} s; a stream sent 1 s later got its first token in {first_token:.2f} s")
    assert big[0].status_code == 200 and len(big[0].json()["choices"]) == 256
    assert first_token is not None and first_token <= 4 * GAP_LIMIT_S


@pytest.mark.slow
def test_huge_prompts_hold_neither_the_tokenizer_nor_memory(hostage_server, long_form, figures):
    """Issue 51 item 2: six concurrent 5 MB non-ASCII prompts (2.4M tokens each, refused as too
    long only once tokenized) delayed an unrelated 5-token completion from 0.04 s to 11.9 s and
    grew the server by 1.5 GiB. Here six prompts just under the character bound (a few hundred
    thousand tokens each) go at once; a small completion sent among them is answered within the
    gap limit, each huge one is refused naming the context, and memory comes back."""
    url, process = hostage_server.url, psutil.Process(hostage_server.pid)
    chars = 600_000
    text = ("日本語の文章と説明 " * (chars // 10))[:chars]
    results: list[httpx.Response] = []

    def huge() -> None:
        results.append(httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 5}, timeout=600))

    rss_before = process.memory_info().rss
    peak, stop = [rss_before], threading.Event()
    sampler = threading.Thread(target=_rss_sampler, args=(hostage_server.pid, stop, peak), daemon=True)
    sampler.start()
    start = time.monotonic()
    senders = [threading.Thread(target=huge) for _ in range(6)]
    for sender in senders:
        sender.start()
    time.sleep(0.3)  # the huge bodies are in
    small_start = time.monotonic()
    small = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 5}, timeout=600)
    small_seconds = time.monotonic() - small_start
    for sender in senders:
        sender.join(600)
    seconds = time.monotonic() - start
    stop.set()
    sampler.join(5)
    rss_after = process.memory_info().rss
    figures("hostage", f"six {chars:,}-character prompts at once: {[r.status_code for r in results]} in {seconds:.1f} s; a "
                       f"5-token completion among them {small.status_code} in {small_seconds:.2f} s; RSS "
                       f"{rss_before / MIB:.0f} -> peak {peak[0] / MIB:.0f} -> {rss_after / MIB:.0f} MiB")
    assert small.status_code == 200 and small_seconds <= GAP_LIMIT_S
    assert [r.status_code for r in results] == [400] * 6
    assert all("context" in r.json()["error"]["message"] and r.json()["error"]["param"] == "prompt" for r in results)
    assert peak[0] - rss_before <= 256 * MIB and rss_after - rss_before <= 128 * MIB


@pytest.mark.slow
def test_distinct_heavy_grammars_keep_memory_within_the_cache_budget(long_form, figures):
    """Many distinct heavy grammars, one at a time: the server's resident memory after them
    stays within the cache's byte budget + 10% over what it held before the first."""
    count, budget = (300, 256 * MIB) if long_form else (12, 64 * MIB)
    with serving(default_model_file(), *FLAGS, "--structured-outputs-cache-bytes", str(budget)) as server:
        process = psutil.Process(server.pid)
        small = {"model": MODEL, "prompt": "Yes or no?", "max_tokens": 2, "structured_outputs": {"choice": ["yes", "no"]}}
        warm = httpx.post(server.url + "/v1/completions", json=small, timeout=120)  # the compiler is built
        assert warm.status_code == 200, warm.text
        before = process.memory_info().rss
        peak = before
        statuses = []
        start = time.monotonic()
        for index in range(count):
            response = httpx.post(server.url + "/v1/completions", json=heavy_grammar(index, long_form), timeout=600)
            statuses.append(response.status_code)
            peak = max(peak, process.memory_info().rss)
        after = process.memory_info().rss
        growth = after - before
        figures(
            "hostage",
            f"{count} distinct heavy grammars in {time.monotonic() - start:.0f} s ({statuses.count(200)} served): RSS "
            f"{before / MIB:.0f} -> peak {peak / MIB:.0f} -> {after / MIB:.0f} MiB ({growth / MIB:+.0f} MiB; cache budget "
            f"{budget / MIB:.0f} MiB, bound {1.1 * budget / MIB:.0f} MiB)",
        )
        assert statuses.count(200) == count, json.dumps(statuses)
        assert growth <= 1.1 * budget and peak - before <= 1.1 * budget + 64 * MIB


@pytest.mark.slow
def test_a_compile_past_the_time_limit_does_not_hold_the_next_grammar(tiny_llama, figures):
    """A choice of 60,000 strings takes seconds to compile; under a limit of 0.5 s it gets the
    limit's 400 and the same spec again gets it at once, while a small grammar sent next is
    served before the big one's compile (still running on a retired thread) could have ended."""
    with serving(tiny_llama, "--structured-outputs-compile-seconds", "0.5") as server:
        def post(choices: list[str]) -> tuple[httpx.Response, float]:
            body = {"model": SERVED_MODEL, "prompt": "Pick one", "max_tokens": 2, "structured_outputs": {"choice": choices}}
            start = time.monotonic()
            response = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
            return response, time.monotonic() - start

        # The grammar compiler is built with the first grammar: on a slow machine that alone can
        # pass the limit (the build goes on in the background), so the warm-up may take a few
        # tries, each a new spec (a refused one is refused again at once).
        for attempt in range(30):
            warm, _ = post(["yes", f"no{attempt}"])
            if warm.status_code == 200:
                break
            time.sleep(1.0)
        assert warm.status_code == 200, warm.text
        heavy = words(60000, 8)
        slow, slow_seconds = post(heavy)
        again, again_seconds = post(heavy)
        small, small_seconds = post(["left", "right"])
        figures("hostage", f"a compile past a 0.5 s limit: {slow.status_code} in {slow_seconds:.2f} s, the same spec "
                           f"{again.status_code} in {again_seconds:.2f} s, a small grammar next {small.status_code} in "
                           f"{small_seconds:.2f} s")
        for refused in (slow, again):
            error = refused.json()["error"]
            assert refused.status_code == 400 and "structured_outputs_compile_seconds" in error["message"], refused.text
            assert error["param"] == "structured_outputs.choice"
        assert small.status_code == 200 and small_seconds < 1.5 and again_seconds < 0.5
