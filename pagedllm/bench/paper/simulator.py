"""The simulated clock: the engine's own `EngineCore` (scheduler, KV cache managers, output
processing), with the model replaced by an executor that charges a per-step cost.

Requests of a trace arrive at their (virtual) times; every step the real `Scheduler` (or
`ReservationScheduler`) decides the batch, the real `OutputProcessor` appends tokens and decides
forks of samples and beams, the scheduler applies them and frees finished sequences, and the
clock advances by what the profile says the step costs. Output lengths are forced (`max_tokens` with `ignore_eos`), so every decision
depends only on lengths: sampled token ids are placeholders, and beam candidates get random
log-probabilities, so beams fork and die as they do in a real search.

The same bookkeeping (`RunRecorder`) measures real-clock runs (`real.py`).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from pagedllm.config import SchedulerConfig
from pagedllm.core import KVPolicy, Scheduler, create_scheduler
from pagedllm.core.kv_breakdown import KVBreakdownAverage
from pagedllm.core.model_output import ModelRunnerOutput, SampledToken, SequenceStepOutput
from pagedllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.requests import RequestRegistry, make_sequence_group
from pagedllm.sampling_params import SamplingParams, SamplingType

from pagedllm.bench.paper.costs import Scale, step_work
from pagedllm.bench.paper.traces import TraceRequest

# The systems of the paper's figures: the name it plots them under -> this engine's kv_policy.
SYSTEMS = {
    "vLLM": "paged",
    "Orca (Oracle)": "orca-oracle",
    "Orca (Pow2)": "orca-pow2",
    "Orca (Max)": "orca-max",
    "FasterTransformer": "static",
}


@dataclass(frozen=True)
class Setup:
    """One serving system at one scale."""

    policy: str  # a kv_policy
    scale: Scale
    block_size: int | None = None  # None: the scale's
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = False
    enable_block_sharing: bool = True
    pad_static: bool = True  # price a static batch's padding (FasterTransformer computes it)

    @property
    def bs(self) -> int:
        return self.block_size or self.scale.block_size


def sampling_params(req: TraceRequest) -> SamplingParams:
    if req.beam_width:
        width = req.beam_width
        return SamplingParams(
            n=width, best_of=width, use_beam_search=True, temperature=0, max_tokens=req.output_len, ignore_eos=True
        )
    if req.n > 1:
        return SamplingParams(n=req.n, temperature=1.0, seed=0, max_tokens=req.output_len, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=req.output_len, ignore_eos=True)


class _PlaceholderTokenizer:
    """Every token decodes to one character: detokenizing costs next to nothing."""

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False) -> str:
        return "x" * len(ids)


@dataclass
class RunResult:
    """One run of one trace on one system, and what the figures read from it."""

    system: str
    rate: float
    num_requests: int
    normalized_latency: float  # mean over requests of latency / output tokens (s/token)
    mean_latency: float
    duration: float  # from the first arrival to the last finish
    mean_batched_requests: float  # requests in a step, averaged over steps
    kv_breakdown: dict[str, float]  # averaged over every step (the engine's statistic)
    kv_breakdown_loaded: dict[str, float]  # averaged over the steps while requests waited (memory full); {} if none did
    num_steps: int
    num_preemptions: int
    num_failed: int
    mean_blocks_used: float = 0.0
    mean_blocks_unshared: float = 0.0  # what the same sequences would hold without sharing
    wall_s: float = 0.0  # how long the run took here
    clock: str = "simulated"

    @property
    def sharing_saving(self) -> float:
        if not self.mean_blocks_unshared:
            return 0.0
        return 1.0 - self.mean_blocks_used / self.mean_blocks_unshared

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items()}
        out["sharing_saving"] = self.sharing_saving
        return out


@dataclass
class RunRecorder:
    """Per-request latencies and per-step averages of one run, on any clock."""

    trace: list[TraceRequest]
    track_sharing: bool = False
    finish: dict[str, float] = field(default_factory=dict)
    batch_of: dict[str, int] = field(default_factory=dict)  # static batching: request -> batch
    num_steps: int = 0
    batched_requests: int = 0
    blocks_used: int = 0
    blocks_unshared: int = 0
    num_failed: int = 0
    loaded_breakdown: KVBreakdownAverage = field(default_factory=KVBreakdownAverage)

    def on_step(self, out: SchedulerOutput, scheduler: Scheduler) -> None:
        """After a step's outputs are processed and its finished sequences freed."""
        self.num_steps += 1
        self.batched_requests += len({item.request_id for item in out.seqs})
        if scheduler.waiting:
            live = (seq for group in scheduler.running for seq in group.seqs if not seq.is_finished)
            self.loaded_breakdown.add(scheduler.block_manager.slot_breakdown(live))
        if self.track_sharing:
            bm = scheduler.block_manager
            self.blocks_used += bm.num_total_blocks - bm.num_free_blocks
            self.blocks_unshared += sum(
                bm.blocks_for_tokens(seq.num_computed_tokens)
                for group in scheduler.running
                for seq in group.seqs
                if not seq.is_finished and bm.has_blocks(seq.seq_id)
            )

    def result(self, system: str, rate: float, scheduler: Scheduler, clock: str, wall_s: float) -> RunResult:
        finish = dict(self.finish)
        if self.batch_of:  # a static batch returns all its outputs when its longest ends
            ends: dict[int, float] = {}
            for request_id, batch in self.batch_of.items():
                if request_id in finish:
                    ends[batch] = max(ends.get(batch, 0.0), finish[request_id])
            finish = {rid: ends[self.batch_of[rid]] if rid in self.batch_of else t for rid, t in finish.items()}
        latencies, normalized = [], []
        for i, req in enumerate(self.trace):
            end = finish.get(str(i))
            if end is None:
                continue
            latencies.append(end - req.arrival)
            normalized.append((end - req.arrival) / req.output_len)
        steps = max(1, self.num_steps)
        return RunResult(
            system=system,
            rate=rate,
            num_requests=len(self.trace),
            normalized_latency=sum(normalized) / max(1, len(normalized)),
            mean_latency=sum(latencies) / max(1, len(latencies)),
            duration=max(finish.values(), default=0.0) - (self.trace[0].arrival if self.trace else 0.0),
            mean_batched_requests=self.batched_requests / steps,
            kv_breakdown=scheduler.kv_breakdown.fractions(),
            kv_breakdown_loaded=self.loaded_breakdown.fractions() if self.loaded_breakdown.num_steps else {},
            num_steps=self.num_steps,
            num_preemptions=scheduler.stats.num_preemptions,
            num_failed=self.num_failed,
            mean_blocks_used=self.blocks_used / steps,
            mean_blocks_unshared=self.blocks_unshared / steps,
            wall_s=wall_s,
            clock=clock,
        )


def _placeholder_samples(item: ScheduledSequence, rng: random.Random) -> list[SampledToken]:
    params = item.sampling_params
    if params.sampling_type is SamplingType.BEAM:
        return [SampledToken(1 + k, -rng.expovariate(1.0)) for k in range(2 * params.best_of)]
    return [SampledToken(1, -1.0)] * item.num_samples


@dataclass
class SimulatedExecutor:
    """The model on the simulated clock: each step advances `clock` by what `cost` prices it at
    and returns placeholder samples."""

    scheduler: Scheduler
    setup: Setup
    cost: object  # a profile from costs.py, at the setup's block size
    recorder: RunRecorder
    rng: random.Random
    clock: float = 0.0
    num_batches: int = 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if not out.seqs and not out.has_cache_work:
            return ModelRunnerOutput()  # only finished ids for the workers: no model time
        static = self.setup.policy == KVPolicy.STATIC.value
        batch = self.scheduler.current_batch if static else None
        if static and self.scheduler.num_batches != self.num_batches:  # a new batch starts
            self.num_batches = self.scheduler.num_batches
            for group in batch:
                self.recorder.batch_of[group.request_id] = self.num_batches
        paged = self.setup.policy == KVPolicy.PAGED.value
        self.clock += self.cost.step_seconds(step_work(out, paged, batch if self.setup.pad_static else None))
        samples = {item.seq_id: _placeholder_samples(item, self.rng) for item in out.seqs if item.num_samples}
        return ModelRunnerOutput({seq_id: SequenceStepOutput(samples=s) for seq_id, s in samples.items()})


def simulate(
    system: str, trace: list[TraceRequest], setup: Setup, cost, rate: float = 0.0, track_sharing: bool = False, seed: int = 0
) -> RunResult:
    """Run `trace` on the simulated clock priced by `cost` (a profile from `costs.py`)."""
    wall = time.perf_counter()
    scale = setup.scale
    cost = cost.with_block_size(setup.bs)
    config = SchedulerConfig(
        max_num_seqs=scale.max_num_seqs,
        max_num_batched_tokens=scale.max_num_batched_tokens,
        preemption_mode=setup.preemption_mode,
        swap_cost_per_block=cost.swap_seconds_per_block(),
        recompute_cost_per_token=cost.recompute_seconds_per_token(),
        kv_policy=setup.policy,
    )
    scheduler = create_scheduler(
        config,
        setup.bs,
        scale.num_blocks(setup.bs),
        scale.num_cpu_blocks(setup.bs),
        scale.max_model_len,
        enable_prefix_caching=setup.enable_prefix_caching,
        share_blocks=setup.enable_block_sharing,
    )
    requests = RequestRegistry()
    processor = OutputProcessor(_PlaceholderTokenizer(), requests, scale.max_model_len, [])
    recorder = RunRecorder(trace, track_sharing=track_sharing)
    executor = SimulatedExecutor(scheduler, setup, cost, recorder, random.Random(seed))
    core = EngineCore(scheduler, executor, processor.process, requests)
    next_index = 0
    while next_index < len(trace) or core.has_unfinished():
        while next_index < len(trace) and trace[next_index].arrival <= executor.clock:
            req = trace[next_index]
            params = sampling_params(req)
            core.add(make_sequence_group(str(next_index), req.prompt_token_ids, params, requests, req.arrival,
                                         share_blocks=setup.enable_block_sharing))
            next_index += 1
        if not core.has_unfinished():
            executor.clock = trace[next_index].arrival
            continue
        step = core.step()
        recorder.num_failed += len(step.failed)
        out = step.scheduled
        if out is None or (not out.seqs and not out.has_cache_work):
            if not core.has_unfinished():  # what waited has just failed (it can never fit)
                continue
            if next_index >= len(trace):
                raise RuntimeError("the simulation stalled: requests wait but nothing runs")
            executor.clock = trace[next_index].arrival
            continue
        recorder.on_step(out, scheduler)
        for group in step.touched:
            if group.is_finished:
                recorder.finish[group.request_id] = executor.clock
    return recorder.result(system, rate, scheduler, "simulated", time.perf_counter() - wall)
