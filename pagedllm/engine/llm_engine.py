"""The engine: requests in, `RequestOutput`s out, one `step()` at a time.

Each step the scheduler builds the control message, the executor runs it on every worker, and
the output processor appends the sampled tokens, forks samples and beams, and checks stop
conditions; finished sequences release their blocks at once.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections.abc import Iterable

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.core import BlockManager, Scheduler, Sequence, SequenceGroup, SequenceStatus
from pagedllm.core.model_output import ModelRunnerOutput
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.stats import EngineStats, StepTime
from pagedllm.executor import Executor, WorkerDiedError, create_executor
from pagedllm.model import get_tokenizer, load_arch_config, resolve_model
from pagedllm.model.tokenizer import eos_token_ids
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams, SamplingType

logger = logging.getLogger("pagedllm")

Prompt = str | list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        source = resolve_model(config.model.model)
        self.model_name = source.name
        self.arch = load_arch_config(source)
        self.max_model_len = self._resolve_max_model_len()
        self.arch.check_tensor_parallel_size(config.parallel.tensor_parallel_size)
        self.tokenizer = get_tokenizer(source)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.arch.eos_token_ids)

        self.executor: Executor = create_executor(config, self.max_model_len)
        num_device_blocks, num_cpu_blocks = self.executor.determine_num_blocks()
        self._check_cache_fits(num_device_blocks)
        self.executor.init_cache(num_device_blocks, num_cpu_blocks)
        block_size = config.cache.block_size
        logger.info(
            "KV cache: %d device blocks of %d tokens (%d tokens, %.2f GiB); %d CPU swap blocks",
            num_device_blocks,
            block_size,
            num_device_blocks * block_size,
            num_device_blocks * self.executor.block_bytes / 2**30,
            num_cpu_blocks,
        )
        if config.scheduler.preemption_mode == "auto" and num_cpu_blocks:
            swap_cost, recompute_cost = self.executor.profile_preemption_costs()
            config.scheduler.swap_cost_per_block = swap_cost
            config.scheduler.recompute_cost_per_token = recompute_cost
            logger.info(
                "Preemption costs: %.3g ms to swap a block out and in, %.3g ms to recompute a token",
                swap_cost * 1e3,
                recompute_cost * 1e3,
            )
        self.block_manager = BlockManager(
            block_size,
            num_device_blocks,
            num_cpu_blocks,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            watermark=config.scheduler.watermark,
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self._groups: dict[str, SequenceGroup] = {}
        self._seqs: dict[int, Sequence] = {}
        self._seq_ids = itertools.count()
        self.outputs = OutputProcessor(
            self.tokenizer,
            self.block_manager,
            self.max_model_len,
            self.eos_token_ids,
            new_seq_id=lambda: next(self._seq_ids),
            register_seq=self._register,
            unregister_seq=lambda seq: self._seqs.pop(seq.seq_id, None),
            share_blocks=config.cache.enable_block_sharing,
        )
        self.num_prompt_tokens_total = 0
        self.num_computed_tokens_total = 0
        self.dead: str | None = None  # why the engine can no longer run (a worker died)
        self.step_time = StepTime()
        self.num_steps = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    # --- set-up checks ----------------------------------------------------------------------

    def _resolve_max_model_len(self) -> int:
        limit = self.arch.max_position_embeddings
        if self.arch.sliding_window is not None and self.arch.sliding_window < limit:
            # Attention over the full context would differ from the model's windowed attention
            # beyond the window, so the context stops there.
            limit = self.arch.sliding_window
        asked = self.config.model.max_model_len
        if asked is None:
            return limit
        if asked > limit:
            raise ValueError(
                f"max_model_len={asked} exceeds what the model supports ({limit} positions); "
                f"use max_model_len <= {limit}."
            )
        return asked

    def _check_cache_fits(self, num_device_blocks: int) -> None:
        block_size = self.config.cache.block_size
        needed = -(-self.max_model_len // block_size)
        if num_device_blocks < needed:
            raise ValueError(
                f"The KV cache holds {num_device_blocks} blocks ({num_device_blocks * block_size} tokens), "
                f"fewer than one sequence of max_model_len={self.max_model_len} needs ({needed} blocks). "
                f"Raise kv_cache_memory to at least {needed * self.executor.block_bytes} bytes "
                f"(or num_gpu_blocks to {needed}), or lower max_model_len."
            )

    # --- requests ---------------------------------------------------------------------------

    def _register(self, seq: Sequence) -> None:
        self._seqs[seq.seq_id] = seq

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
        if request_id in self._groups:
            raise ValueError(f"A request with id {request_id!r} is already running; request ids must be unique.")
        token_ids = self.tokenize(prompt)
        self._validate(token_ids, params)
        params = copy.copy(params)
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
        seqs = [Sequence(next(self._seq_ids), token_ids, sample_index=i) for i in range(num_seqs)]
        for seq in seqs:
            self._register(seq)
        group = SequenceGroup(
            request_id=request_id,
            seqs=seqs,
            sampling_params=params,
            arrival_time=arrival,
            prompt=prompt if isinstance(prompt, str) else None,
            metrics=RequestMetrics(arrival_time=arrival),
            forked=num_seqs > 1,
        )
        self._groups[request_id] = group
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
        num_blocks = self.block_manager.num_total_blocks
        if -(-(len(token_ids) + 1) // self.config.cache.block_size) > num_blocks:
            raise ValueError(
                f"The prompt has {len(token_ids)} tokens, more than the KV cache's {num_blocks} blocks can hold; "
                "shorten it or give the engine a larger kv_cache_memory."
            )
        if params.best_of > self.config.scheduler.max_num_seqs:
            raise ValueError(
                f"best_of={params.best_of} exceeds max_num_seqs={self.config.scheduler.max_num_seqs}; "
                "lower best_of (or n) or raise max_num_seqs."
            )
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {vocab}.")

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests at once and free their blocks; unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            group = self.scheduler.abort(request_id)
            if group is not None:
                self._drop(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    # --- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of every request that progressed or ended."""
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        outputs = [self._make_output(g) for g in self._take_failed()]
        if not scheduled.has_model_work and not scheduled.has_cache_work and not scheduled.finished_request_ids:
            return outputs
        scheduled_at = time.perf_counter()
        try:
            result = self.executor.execute(scheduled) or ModelRunnerOutput()
        except WorkerDiedError as exc:
            return outputs + self._fail_everything(str(exc))
        executed_at = time.perf_counter()
        self.num_steps += 1
        now = time.monotonic()
        self.scheduler.on_step_computed(scheduled, self._seqs)
        self.num_computed_tokens_total += scheduled.num_batched_tokens
        committed_at = time.perf_counter()
        touched = self.outputs.process(scheduled, result, self._groups, self._seqs)
        processed_at = time.perf_counter()
        self.scheduler.release_finished()
        released_at = time.perf_counter()
        for group in touched:
            metrics = group.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
            if any(s.output_token_ids for s in group.seqs):
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
            if group.is_finished:
                metrics.finished_time = now
            outputs.append(self._make_output(group))
            if group.is_finished:
                self._drop(group)
        self.step_time.scheduler += (scheduled_at - start) + (committed_at - executed_at) + (released_at - processed_at)
        self.step_time.model += executed_at - scheduled_at
        self.step_time.outputs += (processed_at - committed_at) + (time.perf_counter() - released_at)
        return outputs

    def _fail_everything(self, reason: str) -> list[RequestOutput]:
        """A worker died: every request in flight ends with an error; the engine stops."""
        logger.error("Engine stopped: %s", reason)
        self.dead = reason
        outputs = []
        for group in list(self._groups.values()):
            self.scheduler.abort(group.request_id)
            group.error = f"The engine stopped: {reason}"
            for seq in group.seqs:
                seq.status = SequenceStatus.FINISHED_ERROR
            outputs.append(self._make_output(group))
            self._drop(group)
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

    def _take_failed(self) -> list[SequenceGroup]:
        failed = self.scheduler.take_failed()
        for group in failed:
            logger.warning("%s", group.error)
            self._drop(group)
        return failed

    def _drop(self, group: SequenceGroup) -> None:
        self._groups.pop(group.request_id, None)
        for seq in group.seqs:
            self._seqs.pop(seq.seq_id, None)

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
            from pagedllm.engine.beam_search import ranked_beams

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
            num_cpu_blocks=bm.cpu_pool.num_blocks,
            num_free_cpu_blocks=bm.cpu_pool.num_free_blocks,
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
            num_generation_tokens=self.outputs.num_generated_tokens,
            num_computed_tokens=self.num_computed_tokens_total,
            num_steps=self.num_steps,
            step_time=StepTime(**vars(self.step_time)),
        )

    def shutdown(self) -> None:
        self.executor.shutdown()
