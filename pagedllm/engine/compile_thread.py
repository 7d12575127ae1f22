"""The thread grammars compile on, replaced when a compile runs past its time limit.

A compile cannot be interrupted (xgrammar's C++ runs it to the end), so a grammar that takes
too long would keep the one compile thread busy and every grammar queued behind it waiting.
When its request gives up (`abandon`), the compile's future fails at once and, if it is running,
its thread *retires*: it finishes that compile, drops the result and exits, while a fresh
thread takes the queue, so the next grammar starts at once. At most `max_retired` retired
threads run at a time (each still uses a core and its compile's memory until it ends); past
that, an abandoned compile keeps the thread and the queue waits for it, as with one thread.

Why not a process that is killed: a compiled grammar would have to cross back serialized, and
xgrammar's `serialize_json`/`deserialize_json` of a 30,000-choice grammar (59 MiB) take 3.8 s
and 2.3 s beside its 2.3 s compile, so every heavy grammar would cost three times as long.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Callable

_STOP = None
logger = logging.getLogger("pagedllm")


def _without_frames(exc: BaseException) -> BaseException:
    """`exc` as a failed future keeps it, perhaps for as long as a cache does: without its
    traceback or chained exceptions, whose frames hold the job's arguments (a spec of megabytes).
    An unexpected error is logged with its traceback first."""
    if not isinstance(exc, ValueError):
        logger.error("A job on %s failed", threading.current_thread().name, exc_info=exc)
    exc.__traceback__ = None
    exc.__cause__ = exc.__context__ = None
    return exc


class CompileThread:
    def __init__(self, name: str, max_retired: int = 2) -> None:
        self.name = name
        self.max_retired = max_retired
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running: dict[threading.Thread, Future] = {}  # each thread's job in progress
        self._retired: set[threading.Thread] = set()
        self._active = self._start()

    def _start(self) -> threading.Thread:
        thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
        thread.start()
        return thread

    def submit(self, future: Future, fn: Callable, *args) -> Future:
        """Run `fn(*args)` on the active thread after the jobs queued before it; its outcome
        goes to `future` (unless the future was abandoned first)."""
        self._queue.put((future, fn, args))
        return future

    def abandon(self, future: Future, error: BaseException) -> None:
        """Fail `future` with `error` now; a queued job is skipped, a running one is left to
        a retired thread (within `max_retired`) and the queue goes on on a fresh thread."""
        with self._lock:
            if future.done():
                return
            future.set_exception(error)
            self._retired = {t for t in self._retired if t.is_alive()}
            if self._running.get(self._active) is future and len(self._retired) < self.max_retired:
                self._retired.add(self._active)
                self._active = self._start()

    def is_abandoned(self, future: Future) -> bool:
        """Whether `future` (a job's) was failed by `abandon`: its result is to be dropped."""
        return future.done()

    @property
    def num_retired(self) -> int:
        """Retired threads still finishing an abandoned compile."""
        with self._lock:
            return sum(t.is_alive() for t in self._retired)

    def _serve(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                if me in self._retired:
                    return
            job = self._queue.get()
            if job is _STOP:
                return
            future, fn, args = job
            with self._lock:
                if future.done() or not future.set_running_or_notify_cancel():
                    continue  # abandoned while queued
                self._running[me] = future
            try:
                outcome = (future.set_result, fn(*args))
            except BaseException as exc:
                outcome = (future.set_exception, _without_frames(exc))
            with self._lock:
                del self._running[me]
            try:  # outside the lock: the future's callbacks take the cache's
                outcome[0](outcome[1])
            except InvalidStateError:
                pass  # abandoned meanwhile: the result is dropped
            # Nothing of the job stays referenced here while waiting for the next: an evicted or
            # abandoned grammar goes at once.
            del job, future, fn, args, outcome

    def shutdown(self) -> None:
        """Cancel the queued jobs; the threads exit once their job in progress ends."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not _STOP:
                job[0].cancel()
        self._queue.put(_STOP)
