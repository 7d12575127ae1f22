"""SIGTERM or Ctrl+C with requests in flight: `pagedllm serve` stops admitting but keeps
listening, answering 503 (/health included) while those in flight finish within
--shutdown-timeout, ends the rest with an error event and [DONE] (never a cut stream), and exits
cleanly; a second signal ends every request the same way and exits at once."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx

from tests.server.common import MODEL, start_server_process

# A stream that outlasts the signals and probes below on any machine: 1,000 tokens, one per step.
LONG_CONTEXT = ["--max-model-len", "1024"]
LONG = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1000, "temperature": 0, "ignore_eos": True}


def _start_server(tiny_llama, shutdown_timeout: float, *flags: str):
    """(the process, its URL, its log lines after start-up, the thread collecting them)."""
    return start_server_process(tiny_llama, "--shutdown-timeout", str(shutdown_timeout), *flags)


def _stream_events(url: str, body: dict, on_first_event) -> list[str]:
    """The data of every server-sent event of a streamed completion, and a last `<cut: ...>` if
    the connection broke before the response ended; `on_first_event` runs once the first one has
    arrived (the request is in flight)."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        try:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if len(events) == 1:
                        on_first_event()
        except httpx.TransportError as cut:
            events.append(f"<cut: {cut!r}>")
    return events


class _Signals(threading.Thread):
    """Sends `signals` to `process` `gap_s` apart, on a thread of its own (the caller goes on
    reading a stream); `last_sent` is when the last one went (time.monotonic())."""

    def __init__(self, process: subprocess.Popen, *signals: signal.Signals, gap_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.process, self.signals, self.gap_s = process, signals, gap_s
        self.last_sent = 0.0

    def run(self) -> None:
        for i, sig in enumerate(self.signals):
            if i:
                time.sleep(self.gap_s)
            self.process.send_signal(sig)
            self.last_sent = time.monotonic()

    def __call__(self) -> None:
        self.start()


def _assert_clean_exit(process: subprocess.Popen, log: list[str], reader: threading.Thread) -> None:
    # uvicorn re-raises the signal it handled once shut down, so the exit status says SIGTERM.
    assert process.wait(30) in (0, -signal.SIGTERM)
    reader.join(10)
    text = "".join(log)
    assert "Application shutdown complete" in text and "Traceback" not in text, text[-3000:]


def test_a_request_in_flight_finishes_within_the_shutdown_timeout(tiny_llama):
    process, url, log, reader = _start_server(tiny_llama, shutdown_timeout=60)
    try:
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 120, "temperature": 0, "ignore_eos": True}
        events = _stream_events(url, body, lambda: process.send_signal(signal.SIGTERM))
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "error" not in chunks[-1] and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"]) >= 1
        _assert_clean_exit(process, log, reader)
    finally:
        process.kill()


def test_requests_still_running_at_the_timeout_end_with_an_error_event_and_done(tiny_llama):
    process, url, log, reader = _start_server(tiny_llama, shutdown_timeout=0)
    try:
        # Too long to finish at once: 250 tokens at a budget of one token per sequence per step.
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 250, "temperature": 0, "ignore_eos": True}
        events = _stream_events(url, body, lambda: process.send_signal(signal.SIGTERM))
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["error"]["code"] == "engine_dead" and "shut down" in last["error"]["message"]
        _assert_clean_exit(process, log, reader)
    finally:
        process.kill()


def test_an_idle_server_exits_at_once_on_one_signal(tiny_llama):
    process, url, log, reader = _start_server(tiny_llama, shutdown_timeout=60)
    try:
        assert httpx.get(url + "/health", timeout=30).status_code == 200  # serving: uvicorn's loop runs
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        status = process.wait(30)
        seconds = time.monotonic() - signalled
        assert seconds < 5, f"an idle server took {seconds:.1f} s to exit after SIGTERM (status {status})"
        _assert_clean_exit(process, log, reader)
    finally:
        process.kill()


def test_new_connections_get_503_while_requests_in_flight_drain(tiny_llama):
    """The listening socket stays open through the drain: a load balancer's probe and a new
    request are answered 503 (not refused), so it takes the server out of rotation."""
    process, url, log, reader = _start_server(tiny_llama, 60, *LONG_CONTEXT)
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as stream:
            lines = stream.iter_lines()
            while not next(lines).startswith("data: "):
                pass  # the stream is in flight
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            time.sleep(1.0)  # past the first ticks of uvicorn's loop, which used to close the socket
            answers = {}
            for path, body in (("/health", None), ("/v1/completions", LONG)):
                try:  # each on a new connection
                    answer = httpx.request("POST" if body else "GET", url + path, json=body, timeout=30)
                    answers[path] = answer.status_code
                except httpx.TransportError as exc:
                    answers[path] = repr(exc)
            probed_after = time.monotonic() - signalled
            assert process.poll() is None, f"the server exited (status {process.poll()}) with a stream in flight"
        # The stream's client left: nothing is in flight, so the server exits.
        left = time.monotonic()
        status = process.wait(30)
        seconds = time.monotonic() - left
        assert answers == {"/health": 503, "/v1/completions": 503}, (
            f"new connections {probed_after:.1f} s into the drain got {answers}")
        assert seconds < 10, f"the server took {seconds:.1f} s to exit once nothing was in flight (status {status})"
        _assert_clean_exit(process, log, reader)
    finally:
        process.kill()


def test_a_second_sigterm_exits_at_once(tiny_llama):
    process, url, log, reader = _start_server(tiny_llama, 60, *LONG_CONTEXT)
    try:
        signals = _Signals(process, signal.SIGTERM, signal.SIGTERM)
        events = _stream_events(url, LONG, signals)
        signals.join()
        status = process.wait(30)
        seconds = time.monotonic() - signals.last_sent
        assert seconds < 5, (
            f"the server took {seconds:.1f} s to exit after a second SIGTERM (status {status}, "
            f"{len(events)} events streamed, the last {events[-1][:200]!r})")
    finally:
        process.kill()


def test_a_second_ctrl_c_ends_streams_with_an_error_event_and_done(tiny_llama):
    process, url, log, reader = _start_server(tiny_llama, 60, *LONG_CONTEXT)
    try:
        signals = _Signals(process, signal.SIGINT, signal.SIGINT)
        events = _stream_events(url, LONG, signals)
        signals.join()
        status = process.wait(30)
        reader.join(10)
        text = "".join(log)
        assert events[-1] == "[DONE]", (
            f"the stream ended with {events[-2:]} after {len(events)} events (exit status {status})")
        last = json.loads(events[-2])
        assert last["error"]["code"] == "engine_dead", last
        assert "CancelledError" not in text and "Traceback" not in text, text[-3000:]
        assert status in (0, 130, -signal.SIGINT), f"exit status {status}"
    finally:
        process.kill()
