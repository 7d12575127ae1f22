"""The engine: requests in, `RequestOutput`s out, one `step()` at a time.

Each step the scheduler builds the control message, the executor runs it on every worker, and
the output processor appends the sampled tokens, forks samples and beams, and checks stop
conditions; finished sequences free their blocks at once.
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.core import BlockManager, Scheduler, Sequence, SequenceGroup, SequenceStatus
from pagedllm.engine.beam_search import ranked_beams
from pagedllm.engine.constraints import RequestConstraints
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.requests import RequestRegistry
from pagedllm.engine.stats import EngineStats
from pagedllm.engine.step_budget import StepBudget
from pagedllm.engine.step_timer import StepTimer
from pagedllm.executor import Executor, WorkerDiedError
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams, SamplingType
from pagedllm.transformers_utils import eos_token_ids, get_tokenizer, load_arch_config, resolve_model

if TYPE_CHECKING:
    from pagedllm.engine.spec_decode import Speculator

logger = logging.getLogger("pagedllm")

Prompt = str | list[int]

# Set to 1 to check the KV cache manager's invariants after every step (slow; for tests and debugging).
CHECK_INVARIANTS_ENV = "PAGEDLLM_CHECK_INVARIANTS"


class RequestTooLargeError(ValueError):
    """A request that can never fit the KV cache; `param` names the request field to change."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class LLMEngine:
    """Requests in, `RequestOutput`s out: an `EngineCore` (scheduler, KV cache manager and
    executor), the registry of live requests, the output processor and a step timer."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        source = resolve_model(config.model.model)
        self.model_name = source.name
        self.arch = load_arch_config(source)
        self.max_model_len = self._resolve_max_model_len()
        self.arch.check_tensor_parallel_size(config.parallel.tensor_parallel_size)
        # The tokenizer loads in a thread while the weights load and the KV cache is set up.
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedllm-tokenizer") as pool:
            tokenizer = pool.submit(get_tokenizer, source)
            self.core = EngineCore(config, self.max_model_len)
            self.tokenizer = tokenizer.result()
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.arch.eos_token_ids, self.arch.end_of_turn_tokens)
        self.requests = RequestRegistry()
        limits = config.limits
        self.constraints = RequestConstraints(
            self.tokenizer,
            self.arch.vocab_size,
            self.eos_token_ids,
            cache_bytes=limits.structured_outputs_cache_bytes,
            compile_seconds=limits.structured_outputs_compile_seconds,
        )
        self.output_processor = OutputProcessor(
            self.tokenizer,
            self.core.block_manager,
            self.requests,
            self.max_model_len,
            self.eos_token_ids,
            share_blocks=config.cache.enable_block_sharing,
        )
        self.timer = StepTimer()
        sched = config.scheduler
        self.step_budget = StepBudget(sched.max_step_seconds, sched.max_num_batched_tokens)
        self.scheduler.prompt_chunk_limit = self.step_budget.chunk_limit
        self.speculator = self._make_speculator()
        self.debug_invariants = os.environ.get(CHECK_INVARIANTS_ENV) == "1"
        self.num_prompt_tokens_total = 0
        self.num_computed_tokens_total = 0
        self.num_steps = 0
        self.dead: str | None = None  # why the engine can no longer run (a worker died)

    # The core's parts, for inspection (tests, benchmarks, stats).
    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def block_manager(self) -> BlockManager:
        return self.core.block_manager

    @property
    def executor(self) -> Executor:
        return self.core.executor

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    # --- set-up checks ----------------------------------------------------------------------

    def _make_speculator(self) -> "Speculator | None":
        spec = self.config.speculative
        if spec is None:
            return None
        from pagedllm.engine.spec_decode import Speculator  # (numpy: only when speculating)

        draft = None
        if spec.method == "draft_model":
            from pagedllm.engine.draft_model import DraftModel, check_draft_model

            check_draft_model(spec.model, self.arch.vocab_size, self.tokenizer)
            bm = self.block_manager
            draft = DraftModel(self.config, self.max_model_len, self.core.group_windows, bm.num_total_blocks, bm.num_cpu_blocks)
        return Speculator(spec, self.max_model_len, self.config.scheduler.max_num_batched_tokens, draft)

    def _resolve_max_model_len(self) -> int:
        limit = self.arch.max_position_embeddings
        asked = self.config.model.max_model_len
        if asked is None:
            return limit
        if asked > limit:
            raise ValueError(
                f"max_model_len={asked} exceeds what the model supports ({limit} positions); "
                f"use max_model_len <= {limit}."
            )
        return asked

    # --- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Bad input raises `ValueError` and leaves the engine untouched."""
        if self.dead is not None:
            raise RuntimeError(f"The engine has stopped: {self.dead}")
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"A request with id {request_id!r} is already running; request ids must be unique.")
        token_ids = self.tokenize(prompt)
        self._validate(token_ids, params)
        self.constraints.check(params)
        params = copy.copy(params)
        params.max_tokens = self._max_tokens_that_fit(len(token_ids), params)
        params.all_stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            params.all_stop_token_ids |= self.eos_token_ids_set
        now = time.monotonic()
        arrival = now if arrival_time is None else arrival_time
        # One sequence; parallel samples fork from it once the prompt is computed, sharing its
        # blocks. Without block sharing (a measuring mode), each sample is its own sequence.
        num_seqs = 1
        if params.sampling_type is SamplingType.RANDOM and not self.config.cache.enable_block_sharing:
            num_seqs = params.best_of
        seqs = [Sequence(self.requests.new_seq_id(), token_ids, sample_index=i) for i in range(num_seqs)]
        group = SequenceGroup(
            request_id=request_id,
            seqs=seqs,
            sampling_params=params,
            arrival_time=arrival,
            prompt=prompt if isinstance(prompt, str) else None,
            metrics=RequestMetrics(arrival_time=arrival),
            forked=num_seqs > 1,
        )
        self.requests.add_group(group)
        # A request with a grammar still compiling is scheduled once it is ready (see step).
        if not (params.needs_token_mask and self.constraints.hold(group)):
            self.scheduler.add(group)
        self.num_prompt_tokens_total += len(token_ids)

    @property
    def eos_token_ids_set(self) -> set[int]:
        return set(self.eos_token_ids)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("The prompt is empty; give at least one token.")
        vocab = self.arch.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Prompt token ids must be integers in [0, {vocab}); got {bad[:5]}.")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"The prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len}, "
                f"which leaves no room to generate; shorten the prompt to at most {self.max_model_len - 1} tokens."
            )
        self._check_limits(params)
        if params.best_of > self.config.scheduler.max_num_seqs:
            raise ValueError(
                f"best_of={params.best_of} exceeds max_num_seqs={self.config.scheduler.max_num_seqs}; "
                "lower best_of (or n) or raise max_num_seqs."
            )
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {vocab}.")

    def _check_limits(self, params: SamplingParams) -> None:
        """The engine's per-request limits (RequestLimits): a request above one is refused at
        once, with the limit's name and flag, rather than stalling every other stream."""
        limits = self.config.limits
        param = "best_of" if params.best_of > params.n else "n"
        if params.use_beam_search and params.best_of > limits.max_beam_width:
            raise RequestTooLargeError(
                f"A beam width of {params.best_of} exceeds this engine's limit max_beam_width={limits.max_beam_width} "
                "(--max-beam-width); use a narrower beam, or start the engine with a higher limit.",
                param,
            )
        if not params.use_beam_search and params.best_of > limits.max_n:
            raise RequestTooLargeError(
                f"{param}={getattr(params, param)} exceeds this engine's limit max_n={limits.max_n} (--max-n) on the "
                "parallel samples of one request; ask for fewer, or start the engine with a higher limit.",
                param,
            )

    def _max_tokens_that_fit(self, prompt_len: int, params: SamplingParams) -> int | None:
        """Decide at admission whether the request can ever fit the KV cache, alone, with every
        sample or beam at its full length; a request that cannot is refused here with the numbers
        rather than failed after its prompt was computed. Without `max_tokens` (up to the
        context), the output is bounded by what the cache holds instead."""
        bm = self.block_manager
        num_seqs = 1 if params.sampling_type is SamplingType.GREEDY else params.best_of
        share = self.config.cache.enable_block_sharing
        chunk = self.config.scheduler.max_num_batched_tokens  # a windowed group holds its window plus a step

        def blocks(max_tokens: int) -> int:
            return bm.max_blocks_held(prompt_len, num_seqs, prompt_len + max_tokens, share, max_chunk=chunk)

        usable = bm.usable_blocks
        wanted = params.max_tokens if params.max_tokens is not None else self.max_model_len - prompt_len
        if blocks(wanted) <= usable:
            return params.max_tokens
        least = max(1, params.min_tokens)
        if num_seqs == 1 and blocks(1) > usable:
            raise ValueError(
                f"The prompt has {prompt_len} tokens, more than the KV cache's {usable} usable blocks of "
                f"{bm.block_size} tokens can hold; shorten it or give the engine more KV cache (kv_cache_memory)."
            )
        if params.max_tokens is not None or blocks(least) > usable:
            asked = wanted if params.max_tokens is not None else least
            seqs = f"{num_seqs} sequences ({'beams' if params.use_beam_search else 'samples'}) of" if num_seqs > 1 else "a sequence of"
            param = ("best_of" if params.best_of > params.n else "n") if num_seqs > 1 else "max_tokens"
            raise RequestTooLargeError(
                f"This request can never fit the KV cache: {seqs} up to {prompt_len} prompt + {asked} output "
                f"tokens need up to {blocks(asked)} blocks of {bm.block_size} tokens, but the cache has {usable}. "
                "Lower n/best_of (or the beam width), max_tokens or the prompt's length, or give the engine more "
                "KV cache (kv_cache_memory, --kv-cache-memory).",
                param,
            )
        # The longest output whose blocks fit (blocks() grows with max_tokens).
        low, high = least, wanted
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if blocks(mid) <= usable else (low, mid - 1)
        return low

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests at once and free their blocks; unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            group = self.scheduler.abort(request_id) or self.constraints.drop(request_id)
            if group is not None:
                self.requests.remove_group(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.constraints.pending)

    def check_constraints(self, params: SamplingParams) -> None:
        """Raise the `ValueError` (naming the field) of an invalid grammar in `params`; waits for
        it to compile (cached, so adding the request afterwards finds it ready)."""
        self.constraints.check(params)
        if params.structured_outputs is not None:
            self.constraints.wait_compiled(params.structured_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # --- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of every request that progressed or ended."""
        begin = time.perf_counter()
        with self.timer.part("scheduler"):
            outputs = self._release_compiled()
            if self.speculator is not None:
                self.speculator.propose(self.scheduler)
            scheduled = self.core.schedule()
            outputs += [self._make_output(g) for g in self._take_failed()]
        if not scheduled.has_model_work and not scheduled.has_cache_work and not scheduled.finished_request_ids:
            return outputs
        with self.timer.part("grammar"):
            self.constraints.fill_bitmasks(scheduled, self.requests.seqs)
        try:
            with self.timer.part("model"):
                started = time.perf_counter()
                if self.speculator is not None:
                    self.speculator.fill(scheduled, self.requests.seqs)
                result = self.core.execute(scheduled)
                model_seconds = time.perf_counter() - started
        except WorkerDiedError as exc:
            return outputs + self._fail_everything(str(exc))
        except BaseException:
            self.core.scheduler.requeue_finished(scheduled.finished_request_ids)
            raise
        self.num_steps += 1
        now = time.monotonic()
        with self.timer.part("scheduler"):
            self.core.advance(scheduled, self.requests.seqs, result)
            if self.speculator is not None and scheduled.has_model_work:
                self.speculator.observe(scheduled, result, model_seconds)
            self.num_computed_tokens_total += scheduled.num_batched_tokens
        with self.timer.part("outputs"):
            touched = self.output_processor.process(scheduled, result)
        with self.timer.part("scheduler"):
            self.core.free_finished()
            if self.debug_invariants:
                self.block_manager.check_invariants()
        with self.timer.part("outputs"):
            for group in touched:
                self._update_metrics(group, now)
                outputs.append(self._make_output(group))
                if group.is_finished:
                    self.requests.remove_group(group)
        self._observe_step(scheduled, time.perf_counter() - begin)
        return outputs

    def _observe_step(self, scheduled, seconds: float) -> None:
        """A step that ran the model teaches the step-time budget its cost per prompt token.
        With adaptive speculation, steps that verified proposed tokens are left out: it stops
        while the budget holds prompts back (`Speculator.propose`), so the steps that admit
        prompts verify nothing, and their cost is that of the steps that did not."""
        adaptive = self.speculator is not None and self.speculator.config.adaptive
        if adaptive and any(item.draft_token_ids for item in scheduled.seqs):
            return
        prompt_tokens = sum(len(item.token_ids) for item in scheduled.seqs if len(item.token_ids) > 1)
        self.step_budget.observe(seconds, prompt_tokens)
        self.scheduler.prompt_chunk_limit = self.step_budget.chunk_limit

    @staticmethod
    def _update_metrics(group: SequenceGroup, now: float) -> None:
        metrics = group.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = now
        if any(s.output_token_ids for s in group.seqs):
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
        if group.is_finished:
            metrics.finished_time = now

    def _fail_everything(self, reason: str) -> list[RequestOutput]:
        """A worker died: every request in flight ends with an error; the engine stops."""
        logger.error("Engine stopped: %s", reason)
        self.dead = reason
        outputs = []
        for group in list(self.requests.groups.values()):
            self.scheduler.abort(group.request_id)
            self.constraints.drop(group.request_id)
            group.error = f"The engine stopped: {reason}"
            for seq in group.seqs:
                seq.status = SequenceStatus.FINISHED_ERROR
            outputs.append(self._make_output(group))
            self.requests.remove_group(group)
        return outputs

    def check_health(self) -> None:
        """Raise if the engine cannot run (a worker process died)."""
        if self.dead is not None:
            raise RuntimeError(f"The engine has stopped: {self.dead}")
        try:
            self.executor.check_health()
        except WorkerDiedError as exc:
            self._fail_everything(str(exc))
            raise RuntimeError(f"The engine has stopped: {exc}") from exc

    def _release_compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar is compiled now; fail those whose grammar failed.
        With nothing else to run, wait a moment for a grammar rather than spin."""
        ready, failed = self.constraints.take_ready(wait=not self.scheduler.has_unfinished())
        for group in ready:
            self.scheduler.add(group)
        outputs = []
        for group, error in failed:
            group.error = error
            for seq in group.seqs:
                seq.status = SequenceStatus.FINISHED_ERROR
            outputs.append(self._make_output(group))
            self.requests.remove_group(group)
        return outputs

    def _take_failed(self) -> list[SequenceGroup]:
        failed = self.scheduler.take_failed()
        for group in failed:
            logger.warning("%s", group.error)
            self.requests.remove_group(group)
        return failed

    # --- outputs ----------------------------------------------------------------------------

    def _make_output(self, group: SequenceGroup) -> RequestOutput:
        params = group.sampling_params
        seqs = self._ranked(group)
        outputs = [
            CompletionOutput(
                index=rank if params.sampling_type is SamplingType.BEAM else seq.sample_index,
                text=seq.output_text,
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.output_logprobs) if params.logprobs is not None else None,
                finish_reason=seq.status.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for rank, seq in enumerate(seqs)
        ]
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=group.prompt_logprobs,
            outputs=outputs,
            finished=group.is_finished,
            metrics=group.metrics,
            num_cached_tokens=group.num_cached_tokens or 0,
            error=group.error,
        )

    @staticmethod
    def _ranked(group: SequenceGroup) -> list[Sequence]:
        """The n sequences to report: the best by cumulative log-probability (beam score for
        beams) once finished, else the first n."""
        params = group.sampling_params
        if params.sampling_type is SamplingType.BEAM:
            return ranked_beams(group)[: params.n]
        seqs = sorted(group.seqs, key=lambda s: s.sample_index)
        if group.is_finished and params.best_of > params.n:
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)
        return seqs[: params.n]

    # --- stats ------------------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        bm = self.block_manager
        sched = self.scheduler
        return EngineStats(
            num_total_blocks=bm.num_total_blocks,
            num_free_blocks=bm.num_free_blocks,
            num_cpu_blocks=bm.num_cpu_blocks,
            num_free_cpu_blocks=bm.num_free_cpu_blocks,
            kv_cache_usage=bm.usage,
            num_running=len(sched.running),
            num_running_seqs=sched.num_running_seqs,
            num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped),
            num_preemptions=sched.stats.num_preemptions,
            num_recompute_preemptions=sched.stats.num_recompute_preemptions,
            num_swap_preemptions=sched.stats.num_swap_preemptions,
            num_blocks_swapped_in=sched.stats.num_blocks_swapped_in,
            num_blocks_swapped_out=sched.stats.num_blocks_swapped_out,
            num_copy_on_writes=bm.num_copy_on_writes,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            num_prompt_tokens=self.num_prompt_tokens_total,
            num_generation_tokens=self.output_processor.num_generated_tokens,
            num_computed_tokens=self.num_computed_tokens_total,
            num_steps=self.num_steps,
            step_time=self.timer.snapshot(),
            kv_breakdown=sched.kv_breakdown.fractions(),
            **(self.speculator.stats.as_engine_stats() if self.speculator is not None else {}),
        )

    def shutdown(self) -> None:
        self.constraints.shutdown()
        if self.speculator is not None:
            self.speculator.shutdown()
        self.core.shutdown()
