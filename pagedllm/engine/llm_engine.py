"""The engine's front end: requests in, `RequestOutput`s out, one `step()` at a time.

It tokenizes and checks each request, builds its sequence group and hands it to the
`EngineCore`, which owns the step (schedule -> execute -> the scheduler's update from the
output); from each step's groups it makes the `RequestOutput`s (text, metrics, ranking).
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
from pagedllm.core import BlockManager, Scheduler, Sequence, SequenceGroup
from pagedllm.engine.beam_search import ranked_beams
from pagedllm.engine.constraints import RequestConstraints
from pagedllm.engine.engine_core import EngineCore, start_executor
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.requests import RequestRegistry, make_sequence_group
from pagedllm.engine.startup_summary import log_startup_summary
from pagedllm.engine.stats import EngineStats
from pagedllm.engine.step_budget import StepBudget
from pagedllm.executor import Executor, WorkerDiedError
from pagedllm.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams, SamplingType
from pagedllm.transformers_utils import eos_token_ids, get_tokenizer, load_arch_config, resolve_model

if TYPE_CHECKING:
    from pagedllm.engine.spec_decode import Speculator

logger = logging.getLogger("pagedllm")

Prompt = str | list[int]

# Set to 1 to check the KV cache manager's invariants after every step (slow; for tests and debugging).
CHECK_INVARIANTS_ENV = "PAGEDLLM_CHECK_INVARIANTS"


# The sampling parameters a pooling request's group carries (it samples nothing: the scheduler
# reads a group's seats and penalties from them).
_POOLING_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1)


class RequestTooLargeError(ValueError):
    """A request that can never fit the KV cache; `param` names the request field to change."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _of_core(name: str) -> property:
    return property(lambda self: getattr(self.core, name))


class LLMEngine:
    """Requests in, `RequestOutput`s out: the tokenizer, the admission checks and the outputs,
    over an `EngineCore` (scheduler, KV cache manager, executor, output processing)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        source = resolve_model(config.model.model)
        self.model_name = source.name
        self.model_path = str(source.path)  # the file or folder the weights came from
        self.arch = load_arch_config(source)
        self.max_model_len = self._resolve_max_model_len()
        self.arch.check_tensor_parallel_size(config.parallel.tensor_parallel_size)
        # The tokenizer loads in a thread while the weights load and the KV cache is set up.
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedllm-tokenizer") as pool:
            tokenizer = pool.submit(get_tokenizer, source)
            executor, scheduler = start_executor(config, self.max_model_len)
            self.tokenizer = tokenizer.result()
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.arch.eos_token_ids, self.arch.end_of_turn_tokens)
        requests = RequestRegistry()
        limits = config.limits
        constraints = RequestConstraints(
            self.tokenizer,
            self.arch.vocab_size,
            self.eos_token_ids,
            cache_bytes=limits.structured_outputs_cache_bytes,
            compile_seconds=limits.structured_outputs_compile_seconds,
        )
        self.output_processor = OutputProcessor(self.tokenizer, requests, self.max_model_len, self.eos_token_ids)
        sched = config.scheduler
        self.core = EngineCore(
            scheduler,
            executor,
            self.output_processor.process,
            requests,
            constraints=constraints,
            speculator=self._make_speculator(executor, scheduler),
            step_budget=StepBudget(sched.max_step_seconds, sched.max_num_batched_tokens),
            check_invariants=os.environ.get(CHECK_INVARIANTS_ENV) == "1",
        )
        self.num_prompt_tokens_total = 0
        log_startup_summary(self, source)

    # The core's parts, for inspection (tests, benchmarks, stats).
    scheduler: Scheduler = _of_core("scheduler")
    block_manager: BlockManager = _of_core("block_manager")
    executor: Executor = _of_core("executor")
    requests: RequestRegistry = _of_core("requests")
    constraints: RequestConstraints = _of_core("constraints")
    speculator: "Speculator | None" = _of_core("speculator")
    step_budget: StepBudget = _of_core("step_budget")
    timer = _of_core("timer")
    num_steps: int = _of_core("num_steps")
    dead: str | None = _of_core("dead")  # why the engine can no longer run (a worker died)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    # --- set-up checks ----------------------------------------------------------------------

    def _make_speculator(self, executor: Executor, scheduler: Scheduler) -> "Speculator | None":
        spec = self.config.speculative
        if spec is None:
            return None
        from pagedllm.engine.spec_decode import Speculator  # (numpy: only when speculating)

        draft = None
        if spec.method == "draft_model":
            from pagedllm.engine.draft_model import DraftModel, check_draft_model

            check_draft_model(spec.model, self.arch.vocab_size, self.tokenizer)
            bm = scheduler.block_manager
            draft = DraftModel(self.config, self.max_model_len, executor.group_windows, bm.num_total_blocks, bm.num_cpu_blocks)
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
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        api_request_id: str | None = None,
    ) -> None:
        """Queue a request: generation with `SamplingParams`, or a pooling (embedding) request
        with `PoolingParams`, whose output is a `PoolingRequestOutput`. Bad input raises
        `ValueError` and leaves the engine untouched. `api_request_id` names the API request it
        is one prompt of: the waiting prompts of different API requests are admitted in turn
        (`Scheduler.add`), so that one request of many prompts does not go wholly before a
        request that arrived just after it."""
        if self.dead is not None:
            raise RuntimeError(f"The engine has stopped: {self.dead}")
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"A request with id {request_id!r} is already running; request ids must be unique.")
        if isinstance(params, PoolingParams):
            self._add_pooling_request(request_id, prompt, params, arrival_time, api_request_id)
            return
        token_ids = self.tokenize(prompt)
        self._validate(token_ids, params)
        self.constraints.check(params)
        params = copy.copy(params)
        params.max_tokens = self._max_tokens_that_fit(len(token_ids), params)
        group = make_sequence_group(
            request_id,
            token_ids,
            params,
            self.requests,
            time.monotonic() if arrival_time is None else arrival_time,
            self.eos_token_ids,
            share_blocks=self.config.cache.enable_block_sharing,
            prompt=prompt if isinstance(prompt, str) else None,
        )
        group.api_request_id = api_request_id
        self.core.add(group)
        self.num_prompt_tokens_total += len(token_ids)

    def _add_pooling_request(
        self, request_id: str, prompt: Prompt, params: PoolingParams, arrival_time: float | None,
        api_request_id: str | None,
    ) -> None:
        """A prompt computed and pooled, generating nothing (`pagedllm.engine.pooling`); the
        engine's `PoolerConfig` fills what `params` leaves out."""
        token_ids = params.truncated(self.tokenize(prompt), self.max_model_len)
        self._validate_prompt_tokens(token_ids)
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"The prompt has {len(token_ids)} tokens, more than max_model_len={self.max_model_len}; shorten "
                "it, or give truncate_prompt_tokens to keep its last tokens."
            )
        params = copy.copy(params)
        pooler = self.config.pooler
        params.pooling_type = params.pooling_type or pooler.pooling_type
        params.normalize = pooler.normalize if params.normalize is None else params.normalize
        size = self.embedding_size
        if params.dimensions is not None and params.dimensions > size:
            raise RequestTooLargeError(
                f"dimensions={params.dimensions} is more than this model's {size} hidden dimensions; give at "
                f"most {size}.", "dimensions",
            )
        bm = self.block_manager
        chunk = self.config.scheduler.max_num_batched_tokens
        needed = bm.max_blocks_held(len(token_ids), 1, len(token_ids), self.config.cache.enable_block_sharing,
                                    max_chunk=chunk)
        if needed > bm.usable_blocks:
            raise ValueError(
                f"The prompt has {len(token_ids)} tokens, more than the KV cache's {bm.usable_blocks} usable blocks "
                f"of {bm.block_size} tokens can hold; shorten it or give the engine more KV cache (kv_cache_memory)."
            )
        group = make_sequence_group(
            request_id,
            token_ids,
            _POOLING_SAMPLING,
            self.requests,
            time.monotonic() if arrival_time is None else arrival_time,
            prompt=prompt if isinstance(prompt, str) else None,
        )
        group.pooling_params = params
        group.api_request_id = api_request_id
        self.core.add(group)
        self.num_prompt_tokens_total += len(token_ids)

    @property
    def embedding_size(self) -> int:
        """The width of the final hidden states a pooling request's vector is taken from."""
        return self.arch.word_embed_proj_dim or self.arch.hidden_size

    def _validate_prompt_tokens(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("The prompt is empty; give at least one token.")
        vocab = self.arch.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Prompt token ids must be integers in [0, {vocab}); got {bad[:5]}.")

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        self._validate_prompt_tokens(token_ids)
        vocab = self.arch.vocab_size
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
            self.core.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

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
        return self.core.step(self._outputs).outputs

    def _outputs(self, step) -> list[RequestOutput]:
        outputs = [self._make_output(group) for group in step.failed]
        for group in step.touched:
            self._update_metrics(group, step.time)
            outputs.append(self._make_output(group))
        return outputs

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

    def check_health(self) -> None:
        """Raise if the engine cannot run (a worker process died)."""
        if self.dead is not None:
            raise RuntimeError(f"The engine has stopped: {self.dead}")
        try:
            self.executor.check_health()
        except WorkerDiedError as exc:
            self.core.fail_everything(str(exc))
            raise RuntimeError(f"The engine has stopped: {exc}") from exc

    # --- outputs ----------------------------------------------------------------------------

    def _make_output(self, group: SequenceGroup) -> RequestOutput | PoolingRequestOutput:
        if group.pooling_params is not None:
            result = group.pooled.result if group.pooled is not None else None
            return PoolingRequestOutput(
                request_id=group.request_id,
                outputs=PoolingOutput(result) if result is not None else None,
                prompt_token_ids=group.prompt_token_ids,
                finished=group.is_finished,
                prompt=group.prompt,
                metrics=group.metrics,
                num_cached_tokens=group.num_cached_tokens or 0,
                error=group.error,
            )
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
            num_computed_tokens=self.core.num_computed_tokens,
            num_steps=self.core.num_steps,
            step_time=self.core.timer.snapshot(),
            kv_breakdown=sched.kv_breakdown.fractions(),
            **(self.speculator.stats.as_engine_stats() if self.speculator is not None else {}),
        )

    def shutdown(self) -> None:
        self.core.shutdown()
