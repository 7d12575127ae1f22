"""The engine's side of token constraints (structured outputs, allowed_token_ids, bad_words).

A request with a grammar waits outside the scheduler until its grammar is compiled: compiling
runs on a thread of its own, cached by spec, so a slow schema delays only the requests that use
it, never the batch. Once ready, each of the request's sequences gets a `SequenceConstraint`
(forked with the sequence for samples and beams; kept through swap and recompute preemption,
since it lives on the sequence). Each step, the scheduled sampling sequences that have one get
a row of the step's token bitmask, which the driver's sampler applies to the logits.

`pagedllm.structured` (torch and xgrammar) is imported only when the first request needs it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from pagedllm.core import SchedulerOutput, Sequence, SequenceGroup
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("pagedllm")

# Compiled grammars kept for reuse, least recently used dropped first: clients sending ever new
# schemas must not grow the server's memory without end.
MAX_CACHED_GRAMMARS = 256


def spec_key(spec: StructuredOutputsParams) -> tuple[str, str]:
    """Two specs with the same key compile to the same grammar."""
    value = getattr(spec, spec.kind)
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return spec.kind + ("/compact" if spec.disable_any_whitespace else ""), text


class _Row:
    """Where `fill_step_bitmasks` puts a bitmask row that belongs to no scheduled item."""

    __slots__ = ("token_bitmask",)

    def __init__(self) -> None:
        self.token_bitmask = None


class RequestConstraints:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer  # the engine's own; copied for the compile thread
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._lock = threading.Lock()  # the cache is filled from the engine's and the server's threads
        self._pool: ThreadPoolExecutor | None = None
        self._compiler = None  # pagedllm.structured.GrammarCompiler, built on the compile thread
        self._compiler_error = ""
        self._compiled: collections.OrderedDict[tuple[str, str], Future] = collections.OrderedDict()
        # Requests waiting for their grammar: request id -> (group, compiled grammar's future).
        self.pending: dict[str, tuple[SequenceGroup, Future]] = {}
        self.compile_seconds: dict[tuple[str, str], float] = {}  # per spec, for benchmarks

    # --- compiling (any thread) ---------------------------------------------------------------

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """The future of `spec`'s compiled grammar (started now, or cached); it raises a
        `ValueError` naming the field if the spec is invalid."""
        key = spec_key(spec)
        with self._lock:
            future = self._compiled.get(key)
            if future is not None:
                self._compiled.move_to_end(key)
            else:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-grammar")
                    tokenizer = copy.deepcopy(self._tokenizer)  # a fast tokenizer is not shared across threads
                    self._pool.submit(self._start_compiler, tokenizer)
                future = self._compiled[key] = self._pool.submit(self._compile, key, spec)
                while len(self._compiled) > MAX_CACHED_GRAMMARS:  # requests hold their own futures
                    evicted, _ = self._compiled.popitem(last=False)
                    self.compile_seconds.pop(evicted, None)
        return future

    def _start_compiler(self, tokenizer) -> None:
        try:
            from pagedllm.structured import GrammarCompiler

            self._compiler = GrammarCompiler(tokenizer, self.vocab_size, self.stop_token_ids)
        except Exception as exc:  # every compile then fails with this reason
            logger.exception("The grammar compiler could not be built")
            self._compiler_error = f"{type(exc).__name__}: {exc}"

    def _compile(self, key: tuple[str, str], spec: StructuredOutputsParams):
        import time

        if self._compiler is None:
            raise RuntimeError(f"Structured outputs are unavailable: the grammar compiler could not be built ({self._compiler_error}).")
        start = time.perf_counter()
        compiled = self._compiler.compile(spec)
        self.compile_seconds[key] = time.perf_counter() - start
        return compiled

    # --- requests (the engine's thread) -------------------------------------------------------

    def check(self, params: SamplingParams) -> None:
        """What can be checked at once: token ids inside the vocabulary."""
        vocab = self.vocab_size
        for name in ("logit_bias", "allowed_token_ids"):
            ids = getattr(params, name) or ()
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"SamplingParams.{name} holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}.")

    def bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word's tokens as it would start the text and after a space (as vLLM does)."""
        words: list[list[int]] = []
        for word in params.bad_words or ():
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self._tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in words:
                    words.append(ids)
        return words

    def hold(self, group: SequenceGroup) -> bool:
        """Start what `group` needs; True if it must wait for its grammar (else it is ready,
        its sequences constrained, and the caller schedules it)."""
        params = group.sampling_params
        spec = params.structured_outputs
        if spec is not None:
            future = self.compile(spec)
            if not future.done() or future.exception() is not None:
                self.pending[group.request_id] = (group, future)
                return True
            self._attach(group, future.result())
        else:
            self._attach(group, None)
        return False

    def _attach(self, group: SequenceGroup, compiled) -> None:
        from pagedllm.structured import SequenceConstraint

        params = group.sampling_params
        bad_words = self.bad_words_token_ids(params)
        for seq in group.seqs:
            seq.constraint = SequenceConstraint.create(compiled, self.vocab_size, params.allowed_token_ids, bad_words)

    def take_ready(self, wait: bool) -> tuple[list[SequenceGroup], list[tuple[SequenceGroup, str]]]:
        """Pending groups whose grammar is compiled (constrained now), and those whose grammar
        failed, with why. With `wait` (nothing else to run), waits briefly for one to finish."""
        if not self.pending:
            return [], []
        if wait:
            futures = [future for _, future in self.pending.values()]
            concurrent.futures.wait(futures, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
        ready, failed = [], []
        for request_id, (group, future) in list(self.pending.items()):
            if not future.done():
                continue
            del self.pending[request_id]
            error = future.exception()
            if error is not None:
                failed.append((group, str(error)))
            else:
                self._attach(group, future.result())
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
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
