"""AsyncLLMEngine: the engine's step loop on a background thread (the one that built the engine:
`EngineThread`), each request's outputs streamed to asyncio code through its own stream.

One thread owns the `LLMEngine` (which is not thread-safe) and is the only one to touch it.
Requests enter and leave through a thread-safe inbox; the loop adds and aborts them between
steps, so an aborted request's blocks are free before the next step. Each request's outputs are
handed to its `RequestStream` with `loop.call_soon_threadsafe`, so the event loop never waits
on a step.

When a step raises, every request in flight fails (the step may have left any of them half
computed: a prompt chunk, a copy-on-write, a swap), with `RequestFailedError` naming the cause,
and the engine is checked before it takes new requests: every block back in its pool, the KV
cache manager's invariants intact, and a one-token probe request served. If all holds, the
fault was in those requests' step, not in the engine, and it goes on serving. If not (the
probe fails too, as it does when the device or a worker is gone for good), or when a worker
dies or the health check raises, the engine is dead: every request in flight fails with
`EngineDeadError`, new ones are refused, and `is_healthy` turns false.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedllm.config import EngineArgs
from pagedllm.engine.engine_thread import EngineThread
from pagedllm.engine.iteration_stats import FinishedRequest, IterationStats, RequestTimingTracker, StatLogger
from pagedllm.engine.llm_engine import LLMEngine, Prompt
from pagedllm.engine.stats import EngineStats
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


class EngineDeadError(RuntimeError):
    """The engine's loop stopped on an error; no request can run any more."""


class RequestFailedError(RuntimeError):
    """The engine gave up on one request (e.g. it can never fit in the KV cache)."""


class RequestStream:
    """The consumer's end of one request: iterate it for cumulative `RequestOutput`s.

    Created on an event loop; the engine thread feeds it through that loop. Outputs are
    cumulative, so a consumer that falls behind gets only the latest one (memory stays bounded
    and a slow client receives larger deltas). Iteration ends after the finished output; an
    engine-side failure is raised from the iteration.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.finished = False
        self.num_output_tokens = 0  # of every sequence, as of the latest output delivered
        self._loop = loop
        self._latest: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        self._accepted: asyncio.Future[None] = loop.create_future()

    # --- engine thread side -----------------------------------------------------------------

    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass

    def put(self, item: RequestOutput | BaseException) -> None:
        self._call(self._set, item)

    def resolve(self, error: BaseException | None) -> None:
        """The engine took the request (error None) or refused it."""
        self._call(self._resolve, error)

    def _set(self, item: RequestOutput | BaseException) -> None:
        if not isinstance(self._latest, BaseException):  # an error is never overwritten
            self._latest = item
            self._ready.set()
            if isinstance(item, RequestOutput):  # (a pooling request's output generates nothing)
                self.num_output_tokens = sum(len(c.token_ids) for c in item.outputs)

    def _resolve(self, error: BaseException | None) -> None:
        if self._accepted.done():
            return
        if error is None:
            self._accepted.set_result(None)
        else:
            self._accepted.set_exception(error)

    # --- consumer side ----------------------------------------------------------------------

    async def wait_accepted(self) -> None:
        await self._accepted

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._ready.wait()
        item, self._latest = self._latest, None
        self._ready.clear()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
            if item.error:
                raise RequestFailedError(item.error)
        return item


@dataclass
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams | PoolingParams
    arrival_time: float | None
    stream: RequestStream
    api_request_id: str | None = None


@dataclass
class _Abort:
    request_id: str


class AsyncLLMEngine:
    """An `LLMEngine` driven by a background thread, for servers.

    `add_request` returns a `RequestStream` once the engine has accepted the request (or raises
    its `ValueError`); `generate` wraps that in an async generator that aborts the request when
    the consumer stops early; `abort` frees a request's blocks before the next step.
    """

    # How often an idle loop wakes to check the workers' health and feed stat loggers.
    IDLE_POLL_S = 1.0
    # Steps a probe request (one prompt token, one generated) may take after a step failed.
    _PROBE_MAX_STEPS = 8

    def __init__(
        self, engine: LLMEngine, stat_loggers: list[StatLogger] | None = None, thread: EngineThread | None = None
    ) -> None:
        """`thread`: the thread that built `engine` (`from_engine_args`), which then runs its
        loop; by default a new one."""
        self.engine = engine
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.stats: EngineStats = engine.get_stats()  # the latest snapshot, replaced by the loop
        self.dead_error: BaseException | None = None
        self._inbox: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        # Guards "is it dead?" together with putting into the inbox, so that no request is
        # queued after the dying loop has drained the inbox (it would never be answered).
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}  # the loop thread's own
        self._timing = RequestTimingTracker()
        self._thread = thread or EngineThread()
        self._closed = False
        self.refusing: str | None = None  # why new requests are refused (the server is stopping)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_loggers: list[StatLogger] | None = None) -> "AsyncLLMEngine":
        """Builds the engine on the thread that will run its steps (`EngineThread`); its errors
        (bad arguments, a model that does not load) are raised here."""
        thread = EngineThread()
        return cls(thread.call(LLMEngine.from_engine_args, args), stat_loggers, thread)

    # These never change after the engine is built, so any thread may read them.
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def model_path(self) -> str:
        return self.engine.model_path

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self):
        """The engine's tokenizer; the engine thread uses it too, so callers on other threads
        should work on their own copy."""
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread.running_last

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and not self._stopping.is_set()

    # --- life cycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.run_last(self._run)

    def stop_admitting(self, reason: str) -> None:
        """Refuse new requests from now on (with `EngineDeadError`); those in flight go on."""
        self.refusing = reason

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop (requests in flight fail) and release the executor. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stopping.set()
        self._wake.set()
        self._thread.join_last(timeout)
        self._fail_everything(EngineDeadError("The engine was shut down."))
        self.engine.shutdown()

    # --- requests (any event loop) ----------------------------------------------------------

    async def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams | PoolingParams,
        arrival_time: float | None = None, api_request_id: str | None = None,
    ) -> RequestStream:
        """Queue a request (a pooling one with `PoolingParams`: its stream ends with a
        `PoolingRequestOutput`); returns its stream once the engine has accepted it. Raises the
        engine's `ValueError` for bad input and `EngineDeadError` when the engine is gone.
        `api_request_id`: the API request it is one prompt of (`LLMEngine.add_request`)."""
        self.start()
        stream = RequestStream(request_id, asyncio.get_running_loop())
        with self._lock:
            if not self.is_healthy:
                raise self._dead_error()
            if self.refusing is not None:
                raise EngineDeadError(self.refusing)
            self._inbox.put(_Add(request_id, prompt, params, arrival_time or time.monotonic(), stream, api_request_id))
        self._wake.set()
        try:
            await stream.wait_accepted()
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    async def check_constraints(self, params: SamplingParams) -> None:
        """Raise the `ValueError` (naming the field) of an invalid grammar or token id in
        `params`. The grammar compiles on the compile thread meanwhile (the spec keeps it, so the
        request added next is given this very grammar); neither this loop nor the engine's waits."""
        self.engine.constraints.check(params)
        if params.structured_outputs is not None:
            await self.engine.constraints.wait_compiled_async(params.structured_outputs)

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str, arrival_time: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; closing the generator early aborts it."""
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(request_id)

    async def encode(
        self, prompt: Prompt, params: PoolingParams, request_id: str, arrival_time: float | None = None
    ) -> AsyncIterator[PoolingRequestOutput]:
        """vLLM's `encode`: the outputs of one pooling request, the last with its vector;
        closing the generator early aborts it."""
        async for output in self.generate(prompt, params, request_id, arrival_time):  # type: ignore[arg-type]
            yield output

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, returns at once); its blocks are freed before the
        engine's next step. Unknown or finished ids are ignored."""
        self._inbox.put(_Abort(request_id))
        self._wake.set()

    def _dead_error(self) -> EngineDeadError:
        cause = self.dead_error or "it was shut down"
        return EngineDeadError(f"The engine is not running ({cause}); restart the server.")

    # --- the loop (engine thread) -----------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                iteration = IterationStats(now=time.monotonic())
                self._take_inbox(iteration)
                outputs: list[RequestOutput] = []
                if self.engine.has_unfinished_requests():
                    try:
                        outputs = self.engine.step()
                    except Exception as exc:
                        self._recover_from_failed_step(exc, iteration)  # raises if it cannot
                        outputs = []
                    if self.engine.dead is not None:  # a worker died: the step failed every request
                        raise EngineDeadError(self.engine.dead)
                    iteration.now = time.monotonic()
                    self._timing.observe(outputs, iteration)
                # Stats before outputs: once a client sees its request finished (or a token),
                # /metrics and /stats already show the step that did it, never the one before.
                self.stats = self.engine.get_stats()
                self._record(iteration)
                self._deliver(outputs)
                self.engine.check_health()  # raises once a worker is gone
                if not self.engine.has_unfinished_requests() and self._inbox.empty():
                    # Any request queued after the check above has set the event already.
                    self._wake.wait(self.IDLE_POLL_S)
                    self._wake.clear()
        except BaseException as exc:  # a dead worker or a bug: fail loudly, not silently hang
            logger.exception("The engine loop stopped")
            self.dead_error = exc
            failed = list(self._streams)
            self._fail_everything(EngineDeadError(f"The engine stopped: {exc}"))
            self._record_death(failed)

    def _drain_inbox(self) -> list[_Add | _Abort]:
        commands = []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _take_inbox(self, iteration: IterationStats) -> None:
        for command in self._drain_inbox():
            if isinstance(command, _Add):
                self._add(command)
            elif command.request_id in self._streams:
                self.engine.abort_request(command.request_id)
                del self._streams[command.request_id]
                self._timing.abort(command.request_id, iteration)

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params, command.arrival_time,
                                    command.api_request_id)
        except Exception as exc:  # bad input (ValueError): the engine is untouched
            command.stream.resolve(exc)
            return
        self._streams[command.request_id] = command.stream
        command.stream.resolve(None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted while this step ran
            if output.finished:
                del self._streams[output.request_id]
            stream.put(output)

    # --- a step that raised (engine thread) --------------------------------------------------

    def _recover_from_failed_step(self, exc: Exception, iteration: IterationStats) -> None:
        """Fail every request in flight with the step's error and go on, if the engine is
        provably intact; otherwise raise `EngineDeadError` (the loop then dies)."""
        logger.exception("A step failed; ending every request in flight")
        request_ids = set(self._streams) | set(self.engine.requests.groups)
        self.engine.abort_request(request_ids)
        problem = self._unclean_after_abort() or self._probe()
        if problem is not None:
            raise EngineDeadError(f"a step raised {exc!r}, and the engine cannot go on: {problem}") from exc
        error = RequestFailedError(
            f"The engine's step failed ({type(exc).__name__}: {exc}) and ended this request; the server "
            "goes on serving, so a retry may succeed, but a request that fails this way again is likely "
            "what triggers the fault."
        )
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self._timing.abort(request_id, iteration)
            iteration.finished[-1] = FinishedRequest("error", None, 0, 0)  # counted as failed, not aborted
            stream.put(error)
        logger.warning("The engine is intact after the failed step (%d requests ended); serving on", len(streams))

    def _unclean_after_abort(self) -> str | None:
        """Why the engine is not back to a clean state with no request in it, or None."""
        engine = self.engine
        if engine.has_unfinished_requests() or engine.get_num_unfinished_requests():
            return "requests were left behind after aborting every one"
        stats = engine.get_stats()
        if stats.num_free_blocks != stats.num_total_blocks or stats.num_free_cpu_blocks != stats.num_cpu_blocks:
            return (
                f"{stats.num_total_blocks - stats.num_free_blocks} device and "
                f"{stats.num_cpu_blocks - stats.num_free_cpu_blocks} CPU blocks stayed held with no request"
            )
        try:
            engine.block_manager.check_invariants()
        except AssertionError as broken:
            return f"the KV cache manager is inconsistent ({broken})"
        return None

    def _probe(self) -> str | None:
        """Serve one token of a one-token prompt; why it failed, or None. (It adds one prompt and
        one generated token to the engine's counters.)"""
        request_id = f"pagedllm-probe-{time.monotonic_ns()}"
        try:
            self.engine.add_request(request_id, [0], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            for _ in range(self._PROBE_MAX_STEPS):
                for output in self.engine.step():
                    if output.request_id == request_id and output.finished:
                        return None if output.error is None else f"a probe request failed ({output.error})"
            return f"a probe request did not finish in {self._PROBE_MAX_STEPS} steps"
        except Exception as probe_exc:
            return f"a probe step failed too ({probe_exc!r})"
        finally:
            self.engine.abort_request(request_id)

    def _record(self, iteration: IterationStats) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(self.stats, iteration)
            except Exception:  # metrics must never take the engine down
                logger.exception("Stat logger %r failed", stat_logger)

    def _record_death(self, failed: list[str]) -> None:
        """The loop died and every request in flight failed: the stat loggers see that last
        (each one finished by error, no request running or waiting), so /metrics does not show
        them running for as long as the process lives."""
        iteration = IterationStats(now=time.monotonic())
        iteration.finished.extend(FinishedRequest("error", None, 0, 0) for _ in failed)
        try:
            self.engine.abort_request(list(self.engine.requests.groups))  # their blocks, freed where it can
            stats = self.engine.get_stats()
        except Exception:  # the engine may be too broken to tell: what it held stays as last seen
            stats = self.stats
        self.stats = dataclasses.replace(stats, num_running=0, num_running_seqs=0, num_waiting=0, num_swapped=0)
        self._record(iteration)

    def _fail_everything(self, error: EngineDeadError) -> None:
        with self._lock:
            self._stopping.set()
            for command in self._drain_inbox():
                if isinstance(command, _Add):
                    command.stream.resolve(error)
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.put(error)
