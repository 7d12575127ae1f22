"""SIGTERM with requests in flight: `pagedllm serve` stops admitting, lets them finish within
--shutdown-timeout, ends the rest with an error event and [DONE] (never a cut stream), and exits
cleanly."""

from __future__ import annotations

import json
import signal
import subprocess
import threading

import httpx

from tests.server.common import MODEL, start_server_process


def _start_server(tiny_llama, shutdown_timeout: float):
    """(the process, its URL, its log lines after start-up, the thread collecting them)."""
    return start_server_process(tiny_llama, "--shutdown-timeout", str(shutdown_timeout))


def _stream_events(url: str, body: dict, on_first_event) -> list[str]:
    """The data of every server-sent event of a streamed completion; `on_first_event` runs once
    the first one has arrived (the request is in flight)."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if len(events) == 1:
                    on_first_event()
    return events


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
