"""The engine's side of token constraints (structured outputs, allowed_token_ids, bad_words).

A request with a grammar waits outside the scheduler until its grammar is compiled: compiling
runs on a thread of its own, cached by spec, so a slow schema delays only the requests that use
it, never the batch. Its bad words and allowed_token_ids are prepared the same way, once per
request on a thread of their own (tokenized, folded into a mask and a table of prefixes), never
on the engine's thread. Once ready, each of the request's sequences gets a `SequenceConstraint`
(forked with the sequence for samples and beams; kept through swap and recompute preemption,
since it lives on the sequence). Each step, the scheduled sampling sequences that have one get
a row of the step's token bitmask, which the driver's sampler applies to the logits.

Limits (RequestLimits): every compiled grammar alive in the process counts against
`cache_bytes`: those in the cache, those that requests still hold after the cache let them go,
and room for the one being compiled (the largest of the last few, reserved before it starts).
The cache drops its least recently used grammars until the total fits. A grammar is charged
xgrammar's measure of its own tables times ALLOCATOR_OVERHEAD, the most the C allocator was
measured to take beyond it (not the heap's growth while it compiled: that is process-wide, and
other requests' work would be charged to it), and the freed heap is handed back to the system
after each eviction. A grammar larger than the whole budget is refused, and one that takes
longer than `compile_seconds` to compile fails its request, and the same spec fails at once
after it: the compile runs to its end on a thread retired for it, its result dropped, while the
next grammars compile on a fresh thread (`compile_thread`).

`pagedllm.structured` (torch and xgrammar) is imported only when the first request needs it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import copy
import hashlib
import json
import logging
import math
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

from pagedllm.core import SchedulerOutput, Sequence, SequenceGroup
from pagedllm.engine.compile_thread import CompileThread
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.utils import release_free_memory

logger = logging.getLogger("pagedllm")

# Entries kept for reuse at most (failures included), besides the byte budget. Keys are digests
# and failures keep no traceback, so a failed entry holds a few hundred bytes whatever its spec.
MAX_CACHED_GRAMMARS = 256
# What glibc's heap grows by for a compiled grammar, per byte of xgrammar's `memory_size_bytes`
# (which leaves out its allocations' overhead): 1.06-1.31 measured over choices of 2,000 and
# 30,000 strings, a 60-field schema, a regex, json_object and an EBNF grammar (the default
# model's 49k vocabulary); rounded up.
ALLOCATOR_OVERHEAD = 1.35
# The room reserved for a grammar being compiled: the largest of this many last compiled.
RECENT_SIZES = 8
# Prepared bad words / allowed_token_ids kept for reuse (a client's requests often repeat them).
MAX_CACHED_CONTROLS = 32


class ConstraintLimitError(ValueError):
    """A constraint above one of the engine's limits; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def spec_key(spec: StructuredOutputsParams) -> tuple[str, str]:
    """Two specs with the same key compile to the same grammar (the key holds a digest of the
    spec's text, not the text: a cached failure of a 4 MiB schema costs no 4 MiB)."""
    value = getattr(spec, spec.kind)
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return spec.kind + ("/compact" if spec.disable_any_whitespace else ""), digest


def compile_timeout_error(spec: StructuredOutputsParams, seconds: float) -> ConstraintLimitError:
    return ConstraintLimitError(
        f"The {spec.kind} in {spec.param} did not compile within {seconds:g} s, this engine's limit "
        "structured_outputs_compile_seconds (--structured-outputs-compile-seconds); simplify it, or start the "
        "engine with a higher limit.",
        spec.param,
    )


def grammar_bytes(compiled) -> int:
    """What a compiled grammar is charged against the cache's budget."""
    return math.ceil(int(getattr(compiled, "memory_size_bytes", 0)) * ALLOCATOR_OVERHEAD)


class _Row:
    """Where `fill_step_bitmasks` puts a bitmask row that belongs to no scheduled item."""

    __slots__ = ("token_bitmask",)

    def __init__(self) -> None:
        self.token_bitmask = None


class RequestConstraints:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        cache_bytes: int = 256 << 20,
        compile_seconds: float = 30.0,
    ) -> None:
        self._tokenizer = tokenizer  # the engine's own; copied for the compile and token threads
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_bytes = cache_bytes
        self.compile_seconds_limit = compile_seconds
        self._lock = threading.RLock()  # the caches are filled from the engine's and the server's threads
        self._compile_thread: CompileThread | None = None
        self._compiler = None  # pagedllm.structured.GrammarCompiler, built on the compile thread
        self._compiler_error = ""
        self._compiled: collections.OrderedDict[tuple[str, str], Future] = collections.OrderedDict()
        self._held: dict[int, Future] = {}  # id(spec) -> its future, while the spec object lives
        self._sizes: dict[tuple[str, str], int] = {}  # bytes of each compiled grammar in the cache
        self.cached_bytes = 0
        self.live_bytes = 0  # of every compiled grammar alive: cached, or still held by a request
        self.reserved_bytes = 0  # room kept for the grammar being compiled
        self._recent_sizes: collections.deque[int] = collections.deque(maxlen=RECENT_SIZES)
        self._token_pool: ThreadPoolExecutor | None = None
        self._token_tokenizer = None  # the token thread's copy, made there when first needed
        self._controls: collections.OrderedDict[tuple, Future] = collections.OrderedDict()
        # Requests waiting for their grammar or token controls: request id -> (group, futures,
        # the grammar's spec or None, when it began waiting).
        self.pending: dict[str, tuple[SequenceGroup, list[Future], StructuredOutputsParams | None, float]] = {}
        self.compile_seconds: dict[tuple[str, str], float] = {}  # per spec, for benchmarks

    # --- compiling (any thread) ---------------------------------------------------------------

    def compile(self, spec: StructuredOutputsParams, pin: bool = False) -> Future:
        """The future of `spec`'s compiled grammar (started now, or cached); it raises a
        `ValueError` naming the field if the spec is invalid or its grammar is larger than the
        cache's byte budget. With `pin` (a request's check), the spec object keeps that future
        while it lives: the request then gets the grammar it was checked with when it is
        scheduled, even if the cache let it go meanwhile (compiling it again could fail on a
        busier server, past the budget or the time limit, and fail a request already accepted)."""
        key = spec_key(spec)
        with self._lock:
            future = self._held.get(id(spec))
            if future is not None:  # this very spec was compiled (or checked) before
                if self._compiled.get(key) is future:
                    self._compiled.move_to_end(key)
                return future
            future = self._compiled.get(key)
            if future is not None:
                self._compiled.move_to_end(key)
            else:
                if self._compile_thread is None:
                    self._compile_thread = CompileThread("pagedllm-grammar")
                    tokenizer = copy.deepcopy(self._tokenizer)  # a fast tokenizer is not shared across threads
                    self._compile_thread.submit(Future(), self._start_compiler, tokenizer)
                future = self._compiled[key] = Future()
                self._compile_thread.submit(future, self._compile, key, spec, future)
                self._evict()
            if pin:
                self._held[id(spec)] = future
                weakref.finalize(spec, self._held.pop, id(spec), None)
        return future

    def wait_compiled(self, spec: StructuredOutputsParams):
        """`spec`'s compiled grammar, waiting at most the compile-time limit (then the limit's
        `ValueError`): a request's check, after which the spec keeps its grammar (`compile`'s pin)."""
        future = self.compile(spec, pin=True)
        concurrent.futures.wait([future], timeout=self.compile_seconds_limit)
        if not future.done():
            raise self.give_up(spec)
        return self.outcome(future)

    async def wait_compiled_async(self, spec: StructuredOutputsParams):
        """`wait_compiled` for an event loop: it waits without holding the loop (nor any thread)."""
        future = self.compile(spec, pin=True)
        if not future.done():
            loop = asyncio.get_running_loop()
            finished = loop.create_future()  # set with no value: the compile's error is not copied into it

            def wake(_) -> None:
                with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
                    loop.call_soon_threadsafe(lambda: finished.done() or finished.set_result(None))

            future.add_done_callback(wake)
            try:
                await asyncio.wait_for(finished, self.compile_seconds_limit)
            except (TimeoutError, asyncio.TimeoutError):
                raise self.give_up(spec) from None
        return self.outcome(future)

    @staticmethod
    def outcome(future: Future):
        """The compiled grammar of a finished compile, or its failure raised as a fresh error
        (raising the future's own would tie the caller's frames, and the request in them, to
        the cached failure for as long as the cache keeps it)."""
        error = future.exception()
        if error is None:
            return future.result()
        param = getattr(error, "param", None)
        if isinstance(error, ValueError) and param:
            raise ConstraintLimitError(str(error), param)
        raise type(error)(str(error)) if isinstance(error, (ValueError, RuntimeError)) else RuntimeError(str(error))

    def give_up(self, spec: StructuredOutputsParams) -> ConstraintLimitError:
        """`spec` did not compile within the limit: its compile is abandoned (failed now, and
        cached so, its thread retired if it is running) and the limit's error returned."""
        with self._lock:
            future = self._held.get(id(spec)) or self._compiled.get(spec_key(spec))
        if future is not None and self._compile_thread is not None:
            # The future keeps an error of its own: the one returned gets the raiser's traceback.
            self._compile_thread.abandon(future, compile_timeout_error(spec, self.compile_seconds_limit))
        return compile_timeout_error(spec, self.compile_seconds_limit)

    def _record_size(self, key: tuple[str, str], future: Future, size: int) -> None:
        """A compile finished: count its bytes in the cache (if its entry is still cached), and
        evict the least recently used grammars beyond the budget."""
        with self._lock:
            if self._compiled.get(key) is not future or key in self._sizes:
                return
            self._sizes[key] = size
            self.cached_bytes += size
            self._evict()

    def _track_live(self, compiled, size: int) -> None:
        """Count `compiled` in `live_bytes` until the last reference to it goes (the cache's
        future, a pending request's, a sequence's constraint)."""
        with self._lock:
            self.live_bytes += size
        weakref.finalize(compiled, self._release_live, size)

    def _release_live(self, size: int) -> None:
        with self._lock:
            self.live_bytes -= size

    def _evict(self) -> None:
        """Drop least recently used grammars until every live one and the room reserved for the
        one being compiled fit the budget (the newest entry stays: its request is waiting)."""
        evicted = False
        while len(self._compiled) > 1 and (
            max(self.live_bytes, self.cached_bytes) + self.reserved_bytes > self.cache_bytes
            or len(self._compiled) > MAX_CACHED_GRAMMARS
        ):
            key = next(iter(self._compiled))  # the least recently used; requests hold their own futures
            del self._compiled[key]  # its grammar goes now (live_bytes with it) unless a request holds it
            self.cached_bytes -= self._sizes.pop(key, 0)
            self.compile_seconds.pop(key, None)
            evicted = True
        if evicted:
            release_free_memory()

    def _start_compiler(self, tokenizer) -> None:
        try:
            from pagedllm.structured import GrammarCompiler

            self._compiler = GrammarCompiler(tokenizer, self.vocab_size, self.stop_token_ids)
        except Exception as exc:  # every compile then fails with this reason
            logger.exception("The grammar compiler could not be built")
            self._compiler_error = f"{type(exc).__name__}: {exc}"

    def _compile(self, key: tuple[str, str], spec: StructuredOutputsParams, future: Future):
        if self._compiler is None:
            raise RuntimeError(f"Structured outputs are unavailable: the grammar compiler could not be built ({self._compiler_error}).")
        reserve = min(max(self._recent_sizes, default=0), self.cache_bytes)
        with self._lock:  # room for this one before it is built
            self.reserved_bytes += reserve
            self._evict()
        try:
            start = time.perf_counter()
            compiled = self._compiler.compile(spec)
            elapsed = time.perf_counter() - start
        finally:
            with self._lock:
                self.reserved_bytes -= reserve
        if self._compile_thread.is_abandoned(future):  # its request gave up: nobody wants it
            del compiled
            release_free_memory()
            return None
        size = grammar_bytes(compiled)
        self._recent_sizes.append(size)
        if size > self.cache_bytes:
            del compiled
            release_free_memory()
            raise ConstraintLimitError(
                f"The {spec.kind} in {spec.param} compiles to a grammar of {size / 2**20:.1f} MiB, more than this "
                f"engine's whole compiled-grammar cache ({self.cache_bytes / 2**20:.1f} MiB, "
                "structured_outputs_cache_bytes, --structured-outputs-cache-bytes); simplify it (fewer or shorter "
                "choices, a smaller schema), or start the engine with a larger cache.",
                spec.param,
            )
        self.compile_seconds[key] = elapsed
        self._track_live(compiled, size)
        # Counted before the future resolves, so that a caller who waited for it sees the cache
        # within its budget (the done-callback would run after the waiter wakes).
        self._record_size(key, future, size)
        return compiled

    # --- bad words and allowed_token_ids (any thread) ---------------------------------------

    def prepare_controls(self, params: SamplingParams) -> Future | None:
        """The future of the request's `TokenControls` (bad words tokenized, the fixed mask
        packed), prepared on the token thread and cached; None when it has neither."""
        if not params.bad_words and params.allowed_token_ids is None:
            return None
        allowed = tuple(params.allowed_token_ids) if params.allowed_token_ids is not None else None
        key = (allowed, tuple(params.bad_words or ()))
        with self._lock:
            future = self._controls.get(key)
            if future is not None:
                self._controls.move_to_end(key)
                return future
            if self._token_pool is None:
                self._token_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-tokens")
            future = self._controls[key] = self._token_pool.submit(self._prepare, allowed, key[1])
            while len(self._controls) > MAX_CACHED_CONTROLS:
                self._controls.popitem(last=False)
        return future

    def _prepare(self, allowed: tuple[int, ...] | None, bad_words: tuple[str, ...]):
        from pagedllm.structured import TokenControls

        words = self.bad_words_token_ids(bad_words) if bad_words else []
        return TokenControls(self.vocab_size, list(allowed) if allowed is not None else None, words)

    def bad_words_token_ids(self, bad_words) -> list[list[int]]:
        """Each bad word's tokens as it would start the text and after a space (as vLLM does);
        on the token thread, with its own copy of the tokenizer, in one batched call."""
        if self._token_tokenizer is None:
            self._token_tokenizer = copy.deepcopy(self._tokenizer)
        texts = [t for word in bad_words for t in (word.lstrip(), " " + word.lstrip())]
        encoded = self._token_tokenizer(texts, add_special_tokens=False)["input_ids"]
        seen: set[tuple[int, ...]] = set()
        words: list[list[int]] = []
        for ids in encoded:
            if ids and tuple(ids) not in seen:
                seen.add(tuple(ids))
                words.append(list(ids))
        return words

    # --- requests (the engine's thread) -------------------------------------------------------

    def check(self, params: SamplingParams) -> None:
        """What can be checked at once: token ids inside the vocabulary."""
        vocab = self.vocab_size
        for name in ("logit_bias", "allowed_token_ids"):
            ids = getattr(params, name) or ()
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"SamplingParams.{name} holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}.")
        spec = params.structured_outputs
        if spec is not None:
            ids = [*(spec.reasoning_end_token_ids or ()), spec.reasoning_start_token_id]
            bad = [t for t in ids if t is not None and t >= vocab]
            if bad:
                raise ValueError(f"{spec.field_name}'s reasoning token ids are outside the vocabulary [0, {vocab}): {bad[:5]}.")

    def hold(self, group: SequenceGroup) -> bool:
        """Start what `group` needs; True if it must wait for its grammar or token controls
        (else it is ready, its sequences constrained, and the caller schedules it)."""
        params = group.sampling_params
        spec = params.structured_outputs
        futures = [self.compile(spec)] if spec is not None else []
        controls = self.prepare_controls(params)
        if controls is not None:
            futures.append(controls)
        if all(f.done() and f.exception() is None for f in futures):
            self._attach(group, futures, spec)
            return False
        self.pending[group.request_id] = (group, futures, spec, time.monotonic())
        return True

    def _attach(self, group: SequenceGroup, futures: list[Future], spec: StructuredOutputsParams | None) -> None:
        from pagedllm.structured import ReasoningGate, SequenceConstraint

        compiled = futures[0].result() if spec is not None else None
        controls = futures[-1].result() if len(futures) > (spec is not None) else None
        for seq in group.seqs:
            gate = None
            if spec is not None and spec.reasoning_end_token_ids:  # the grammar waits for the thinking to end
                gate = ReasoningGate(spec.reasoning_end_token_ids, spec.reasoning_start_token_id)
            seq.constraint = SequenceConstraint.create(compiled, self.vocab_size, controls=controls, gate=gate)

    def take_ready(self, wait: bool) -> tuple[list[SequenceGroup], list[tuple[SequenceGroup, str]]]:
        """Pending groups whose grammar and token controls are ready (constrained now), and those
        that failed (a bad grammar, or one past the compile-time limit), with why. With `wait`
        (nothing else to run), waits briefly for one to finish."""
        if not self.pending:
            return [], []
        if wait:
            futures = [f for _, fs, _, _ in self.pending.values() for f in fs if not f.done()]
            concurrent.futures.wait(futures, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
        ready, failed = [], []
        now = time.monotonic()
        for request_id, (group, futures, spec, since) in list(self.pending.items()):
            error = next((f.exception() for f in futures if f.done() and f.exception() is not None), None)
            if error is None and not all(f.done() for f in futures):
                if spec is None or now - since <= self.compile_seconds_limit:
                    continue
                error = self.give_up(spec)
            del self.pending[request_id]
            if error is not None:
                failed.append((group, str(error)))
            else:
                self._attach(group, futures, spec)
                ready.append(group)
        return ready, failed

    def drop(self, request_id: str) -> SequenceGroup | None:
        """Forget a pending request (aborted); returns its group if it was pending."""
        entry = self.pending.pop(request_id, None)
        return entry[0] if entry is not None else None

    # --- per step -----------------------------------------------------------------------------

    def fill_bitmasks(self, scheduled: SchedulerOutput, seqs: dict[int, Sequence]) -> None:
        """Give each constrained sampling sequence of the step its row of allowed tokens."""
        rows = [
            (item, seqs[item.seq_id].constraint)
            for item in scheduled.seqs
            if item.num_samples and seqs[item.seq_id].constraint is not None
        ]
        # A speculating sequence: one more row per proposed token, the constraint advanced past it.
        positions: list[tuple[object, list[_Row]]] = []
        for item, constraint in list(rows):
            if item.draft_token_ids:
                holders = []
                for token in item.draft_token_ids:
                    constraint = constraint.fork()
                    constraint.accept_token(token)
                    holders.append(_Row())
                    rows.append((holders[-1], constraint))
                positions.append((item, holders))
        if rows:
            from pagedllm.structured import fill_step_bitmasks

            fill_step_bitmasks(rows, self.vocab_size)
        for item, holders in positions:
            item.draft_token_bitmasks = [holder.token_bitmask for holder in holders]

    def shutdown(self) -> None:
        if self._compile_thread is not None:
            self._compile_thread.shutdown()
        if self._token_pool is not None:
            self._token_pool.shutdown(wait=False, cancel_futures=True)
