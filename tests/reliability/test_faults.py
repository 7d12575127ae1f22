"""Fault injection: a model step that raises, a tensor-parallel worker killed mid-step, a client
that sends half a body and stalls. Each affected request fails with an error naming the cause;
what happens to the server depends on whether the fault can have damaged it:

- A step that raises once (here: on one poisonous prompt) is a fault of the requests in that
  step, not of the engine: every request in flight fails with 500 `request_failed` naming the
  error (the step may have left any of them half computed: a prompt chunk, a copy-on-write, a
  swap), the engine checks that every block is back and its KV cache manager intact, serves a
  probe request, and the server goes on serving. Dying instead would hand every client that
  finds such an input a way to stop the server.
- A step that keeps raising (a lost device, a broken worker) fails the probe too: the engine
  is dead, requests in flight get 503 `engine_dead` naming the error, /health answers 503 at
  once and the server exits (status 1) so that its supervisor restarts it; a server that can
  only answer 503 serves nobody.
- A killed tensor-parallel worker breaks the process group: the ranks cannot run another step
  together, and rebuilding the group means a new worker loading its shard and every rank
  meeting again, which is a restart. So the same as above: 503 naming the worker and its exit
  code, /health 503 at once, a clean exit with status 1 (no worker left behind).
- A client that stalls in the middle of its body holds only its own connection: the others are
  served as usual, and after --body-idle-timeout (60 s by default, 2 s here) it gets 408 and
  the connection is closed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import threading
import time

import httpx
import psutil
import pytest

from pagedllm.cli import build_parser
from pagedllm.core.model_output import ModelRunnerOutput
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.engine.async_llm_engine import AsyncLLMEngine
from pagedllm.entrypoints.cli_args import engine_args_from
from pagedllm.executor.base import Executor
from tests.reliability.common import BODY_IDLE_TIMEOUT_S, serving
from tests.server.common import MODEL, SERVE_FLAGS, start_server_thread, stats

POISON = 4242  # a prompt holding this token id makes the faulty executor's step raise
GREEDY = {"model": MODEL, "temperature": 0, "ignore_eos": True}


class FaultyExecutor(Executor):
    """The engine's executor with faults injected at its interface: a step raises when it
    computes the poisonous token, or every step once `broken`. Each step takes at least
    STEP_S, so that streams are still in flight when the fault comes, however fast the machine."""

    STEP_S = 0.005

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.block_bytes = inner.block_bytes
        self.broken = False

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        time.sleep(self.STEP_S)
        if self.broken:
            raise RuntimeError("injected fault: the device is gone")
        if any(POISON in seq.token_ids for seq in output.seqs):
            raise RuntimeError("injected fault: this prompt breaks the model")
        return self.inner.execute(output)

    def determine_num_blocks(self):
        return self.inner.determine_num_blocks()

    def init_cache(self, num_device_blocks, num_cpu_blocks):
        self.inner.init_cache(num_device_blocks, num_cpu_blocks)

    def profile_preemption_costs(self):
        return self.inner.profile_preemption_costs()

    def check_health(self) -> None:
        self.inner.check_health()

    def shutdown(self) -> None:
        self.inner.shutdown()


@pytest.fixture
def faulty_server(tiny_llama):
    """A server on a thread of this process whose engine steps through a FaultyExecutor:
    (the uvicorn server, its thread, its URL, the executor)."""
    args = build_parser().parse_args(["serve", str(tiny_llama), "--port", "0", *SERVE_FLAGS])
    engine = AsyncLLMEngine.from_engine_args(engine_args_from(args))
    executor = FaultyExecutor(engine.engine.core.executor)
    engine.engine.core.executor = executor
    server, thread, url = start_server_thread(args, engine)
    yield server, thread, url, executor
    server.should_exit = True
    thread.join(30)


def _open_streams(url: str, count: int, max_tokens: int = 240) -> tuple[list[list[str]], list]:
    """`count` streams, each read to its first event (so in flight) and then by a thread to its
    end: (their events' data, the threads)."""
    events: list[list[str]] = [[] for _ in range(count)]
    first = [threading.Event() for _ in range(count)]

    def read(i: int) -> None:
        body = {**GREEDY, "prompt": [5 + i, 6, 7], "max_tokens": max_tokens, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events[i].append(line[len("data: "):])
                    first[i].set()
        first[i].set()

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for event in first:
        assert event.wait(60), "a stream never started"
    return events, threads


def _error_of(events: list[str]) -> dict | None:
    """The error event before [DONE] (None if the stream ended without one, or without [DONE])."""
    if len(events) < 2 or events[-1] != "[DONE]":
        return None
    return json.loads(events[-2]).get("error")


def test_a_step_that_raises_fails_the_requests_in_flight_and_the_server_goes_on(faulty_server, figures):
    server, thread, url, executor = faulty_server
    probe = {**GREEDY, "prompt": [9, 10, 11], "max_tokens": 8}
    before = httpx.post(url + "/v1/completions", json=probe, timeout=60).json()["choices"][0]["text"]
    events, threads = _open_streams(url, 8)
    poisoned = httpx.post(url + "/v1/completions", json={**GREEDY, "prompt": [5, POISON, 7], "max_tokens": 4}, timeout=60)
    for t in threads:
        t.join(60)
    errors = [_error_of(e) for e in events]
    health = httpx.get(url + "/health", timeout=10).status_code
    after = httpx.post(url + "/v1/completions", json=probe, timeout=60)
    s = stats(url)
    failed_in_flight = sum(1 for e in errors if e and e["code"] == "request_failed" and "injected fault" in e["message"])
    figures(
        "fault: a step raises",
        f"the poisonous request got {poisoned.status_code} {poisoned.json()['error']['code']}, "
        f"{failed_in_flight}/{len(events)} streams in flight ended with request_failed naming the cause and [DONE]; "
        f"then /health {health}, the next request {after.status_code} with the same text as before the fault, "
        f"blocks free {s['num_free_blocks']}/{s['num_total_blocks']}",
    )
    assert poisoned.status_code == 500 and poisoned.json()["error"]["code"] == "request_failed"
    assert "injected fault: this prompt breaks the model" in poisoned.json()["error"]["message"]
    assert failed_in_flight == len(events)
    assert health == 200 and after.status_code == 200 and after.json()["choices"][0]["text"] == before
    assert s["num_free_blocks"] == s["num_total_blocks"] and s["healthy"]
    assert thread.is_alive()


def test_a_step_that_keeps_raising_makes_the_server_unhealthy_and_exit(faulty_server, figures):
    server, thread, url, executor = faulty_server
    events, threads = _open_streams(url, 8)
    broken_at = time.monotonic()
    executor.broken = True
    for t in threads:
        t.join(60)
    errored_at = time.monotonic()
    try:
        health = httpx.get(url + "/health", timeout=10).status_code
    except httpx.TransportError:
        health = "refused (already closed)"
    thread.join(30)
    exited_at = time.monotonic()
    errors = [_error_of(e) for e in events]
    named = sum(1 for e in errors if e and e["code"] == "engine_dead" and "injected fault: the device is gone" in e["message"])
    figures(
        "fault: every step raises",
        f"{named}/{len(events)} streams in flight ended with engine_dead naming the cause and [DONE] "
        f"{errored_at - broken_at:.2f} s after the fault; /health then {health}; the server exited "
        f"{exited_at - broken_at:.1f} s after the fault (engine_died={server.engine_died})",
    )
    assert named == len(events)
    assert health in (503, "refused (already closed)")
    assert not thread.is_alive() and server.engine_died


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _tensor_parallel_worker(server_pid: int) -> psutil.Process:
    """The spawned rank-1 worker among the server's children (not multiprocessing's resource tracker)."""
    children = [p for p in psutil.Process(server_pid).children() if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(children) == 1, [p.cmdline() for p in children]
    return children[0]


def test_a_killed_tensor_parallel_worker_fails_requests_and_the_server_exits_cleanly(tiny_llama, figures):
    with serving(tiny_llama, "--tensor-parallel-size", "2") as server:
        url = server.url
        worker = _tensor_parallel_worker(server.pid)
        events, threads = _open_streams(url, 8)  # the engine is stepping: the kill lands mid-step or between two
        killed_at = time.monotonic()
        os.kill(worker.pid, signal.SIGKILL)
        health = None
        while health is None and time.monotonic() - killed_at < 10:
            try:
                code = httpx.get(url + "/health", timeout=5).status_code
                health = code if code != 200 else None
            except httpx.TransportError:
                health = "refused"
        unhealthy_after = time.monotonic() - killed_at
        for t in threads:
            t.join(60)
        status, text = server.wait_exit(60)
        exited_after = time.monotonic() - killed_at
        errors = [_error_of(e) for e in events]
        cause = f"tensor-parallel worker pagedllm-tp-worker-1 exited (code {-signal.SIGKILL})"
        named = sum(1 for e in errors if e and e["code"] == "engine_dead" and cause in e["message"])
        leftovers = _alive(worker)
        figures(
            "fault: a tensor-parallel worker killed",
            f"{named}/{len(events)} streams in flight ended with engine_dead naming the worker and its exit code, "
            f"and [DONE]; /health {health} {unhealthy_after:.2f} s after the kill; the server exited with status "
            f"{status} {exited_after:.1f} s after it, shutdown complete, no worker left",
        )
        assert named == len(events), errors
        assert health in (503, "refused")
        assert status == 1 and "Application shutdown complete" in text and not leftovers, text[-3000:]


def _answers_until_closed(sockets: list[socket.socket], since: float) -> list[tuple[bytes, float]]:
    """What each socket received until the server closed it, and when that was (since `since`)."""
    answers = []
    for sock in sockets:
        sock.settimeout(BODY_IDLE_TIMEOUT_S + 30)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        answers.append((data, time.monotonic() - since))
        sock.close()
    return answers


def test_clients_that_stall_before_their_headers_end_get_408_and_are_closed(served, figures):
    """Slowloris: clients that connect and send nothing, or half a header line, or a whole request
    and then half of the next one's headers, must not hold their connections forever."""
    port = int(served.url.rsplit(":", 1)[1])
    sends = [b"", b"POST /v1/completions HTTP/1.1\r\nHost: local", b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /hea"]
    sockets = []
    for data in sends * 3:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(data)
        sockets.append(sock)
    stalled_at = time.monotonic()
    assert httpx.get(served.url + "/health", timeout=30).status_code == 200  # served meanwhile
    answers = _answers_until_closed(sockets, stalled_at)
    closed_after = max(seconds for _, seconds in answers)
    figures(
        "fault: clients stall in their headers",
        f"{len(sockets)} clients sent nothing, half a header, or a request and half the next one's headers; each got "
        f"408 and its connection closed {closed_after:.1f} s after stalling (--body-idle-timeout {BODY_IDLE_TIMEOUT_S:g})",
    )
    for (data, _), sent in zip(answers, sends * 3):
        last = data.rsplit(b"HTTP/1.1 ", 1)[-1]  # after the answer to the whole request, if one was sent
        assert last.startswith(b"408 Request Timeout") and b"--body-idle-timeout" in last, (sent, data[-300:])
    assert closed_after < BODY_IDLE_TIMEOUT_S + 5


def test_a_client_that_stalls_mid_body_gets_408_and_others_are_served(served, figures):
    """Ten clients declare 1000 bytes, send 10 and stall; requests meanwhile are served as usual;
    each stalled client gets 408 after --body-idle-timeout and its connection is closed."""
    stalled = []
    for _ in range(10):
        sock = socket.create_connection(("127.0.0.1", int(served.url.rsplit(":", 1)[1])))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n" + b'{"model": ')
        stalled.append(sock)
    stalled_at = time.monotonic()

    async def others() -> list[tuple[int, float]]:
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
            async def one(i: int):
                begin = time.monotonic()
                response = await http.post("/v1/completions", json={**GREEDY, "prompt": [3, i], "max_tokens": 8})
                return response.status_code, time.monotonic() - begin
            return await asyncio.gather(*(one(i) for i in range(10)))

    served_meanwhile = asyncio.run(others())
    served_within = time.monotonic() - stalled_at
    answers = _answers_until_closed(stalled, stalled_at)
    statuses = [data.split(b"\r\n", 1)[0].decode() for data, _ in answers]
    closed_after = max(seconds for _, seconds in answers)
    figures(
        "fault: clients stall mid-body",
        f"{len(stalled)} clients sent 10 of 1000 bytes and stalled; meanwhile {sum(c == 200 for c, _ in served_meanwhile)}"
        f"/{len(served_meanwhile)} other requests got 200 (p50 {statistics.median(s for _, s in served_meanwhile):.2f} s, "
        f"all within {served_within:.1f} s); every stalled client got '{statuses[0]}' and its connection closed "
        f"{closed_after:.1f} s after stalling (--body-idle-timeout {BODY_IDLE_TIMEOUT_S:g})",
    )
    assert all(code == 200 for code, _ in served_meanwhile)
    assert served_within < BODY_IDLE_TIMEOUT_S  # not held up until the stalled clients were dropped
    assert all(s == "HTTP/1.1 408 Request Timeout" for s in statuses), statuses
    assert all(b"--body-idle-timeout" in data for data, _ in answers)
    assert closed_after < BODY_IDLE_TIMEOUT_S + 5
