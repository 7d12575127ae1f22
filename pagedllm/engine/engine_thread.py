"""The thread that builds an engine and then runs its loop (`AsyncLLMEngine`'s)."""

from __future__ import annotations

import concurrent.futures
import functools
import queue
import threading


class EngineThread:
    """The one thread that builds an engine and then runs its loop, so that every OpenMP
    parallel region of the process starts from it.

    libgomp keeps a pool of worker threads per thread that starts parallel regions. Once two
    threads have started them (an engine loaded on the main thread, then stepped on another),
    the process manages more OpenMP threads than it has cores, and libgomp's workers then
    sleep between regions instead of spinning: each of a step's hundreds of regions waits for
    its workers to wake. A served decode step on two cores took 41 ms instead of 22 ms
    (bfloat16, one request), the same engine stepped where it was built.
    """

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="pagedllm-engine", daemon=True)
        self._lock = threading.Lock()
        self._last_started = False

    def _serve(self) -> None:
        while True:
            fn, future, last = self._tasks.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)
            if last:
                return

    def _submit(self, fn, last: bool) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._tasks.put((fn, future, last))
        if not self._thread.is_alive() and self._thread.ident is None:  # started on first use
            self._thread.start()
        return future

    def call(self, fn, *args):
        """fn(*args) on this thread; its result, or its exception raised here."""
        with self._lock:
            future = self._submit(functools.partial(fn, *args), last=False)
        return future.result()

    def run_last(self, fn) -> None:
        """Run fn on this thread as its last task (the engine loop); once only."""
        with self._lock:
            if not self._last_started:
                self._last_started = True
                self._submit(fn, last=True)

    @property
    def running_last(self) -> bool:
        return self._last_started and self._thread.is_alive()

    def join_last(self, timeout: float | None) -> None:
        if self._last_started:
            self._thread.join(timeout)
