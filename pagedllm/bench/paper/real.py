"""The real clock: the profile's model (the default one unless it names another) really runs
every step of a trace.

Requests arrive at their trace times; each step runs the real `LLMEngine` (scheduler, KV cache
manager, model, sampling, detokenizing) and the clock advances by what the step took, measured
as the CPU time of the thread that runs it with torch held to one thread (the `cpu` profile),
or as wall time where the profile runs several threads (`cpu-1b`: the CPU time of one thread
no longer measures a step whose kernels run on two). Measured on one thread, the clock is the
run's own work and not the other programs sharing this machine; with several, the machine must
be quiet. When nothing runs, the clock jumps to the next arrival.

One model load serves every memory policy: `use_policy` gives the engine a fresh scheduler and
KV cache manager (the KV pools and the model stay).
"""

from __future__ import annotations

import dataclasses
import time

from pagedllm.bench.paper.costs import Scale, StepWork, step_work
from pagedllm.bench.paper.simulator import RunRecorder, RunResult, sampling_params
from pagedllm.bench.paper.traces import TraceRequest
from pagedllm.core import KVPolicy, SchedulerOutput, create_scheduler


def build_engine(scale: Scale, num_blocks: int | None = None, policy: str = "paged", swap_space: float = 0.0,
                 model: str | None = None, threads: int = 1):
    """`model` (default: the embedded one) at `scale` on `threads` threads (no prefix caching,
    recomputation). A model given by path (the cpu-1b profile's GGUF file) runs on int8
    activations where the start-up trial finds them faster (`int8_activations="auto"`, llama.cpp's
    numerics): the traces force every output's length, so the text does not matter, and on AMX
    the int8 tiles make a step of many sequences cheaper (csrc/gguf_amx_int8.h)."""
    import torch

    from pagedllm.config import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine

    torch.set_num_threads(threads)
    args = EngineArgs(
        **({"model": model} if model else {}),
        max_model_len=scale.max_model_len,
        block_size=scale.block_size,
        num_gpu_blocks=num_blocks or scale.num_blocks(),
        swap_space=swap_space,
        enable_prefix_caching=False,
        preemption_mode="recompute",
        max_num_seqs=scale.max_num_seqs,
        max_num_batched_tokens=scale.max_num_batched_tokens,
        kv_policy=policy,
        disable_log_stats=True,
        int8_activations="auto" if model else "off",
    )
    return LLMEngine.from_engine_args(args)


def use_policy(engine, policy: str) -> None:
    """Give the engine a fresh scheduler and KV cache manager of `policy` (nothing may be running)."""
    if engine.has_unfinished_requests():
        raise RuntimeError("switch the memory policy only between runs")
    old = engine.scheduler
    config = dataclasses.replace(old.config, kv_policy=policy)
    bm = old.block_manager
    scheduler = create_scheduler(
        config, bm.block_size, bm.num_total_blocks, bm.num_cpu_blocks, engine.max_model_len, enable_prefix_caching=False,
        group_windows=engine.executor.group_windows, share_blocks=old.share_blocks,
    )
    engine.core.scheduler = scheduler


def timed_step(engine) -> tuple[list, SchedulerOutput | None, float]:
    """One engine step: (outputs, its control message, seconds): this thread's CPU time when
    torch runs on one thread, else wall time."""
    import torch

    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    start = clock()
    outputs = engine.step()
    return outputs, engine.core.last_scheduled, clock() - start


def run_real(
    engine, system: str, policy: str, trace: list[TraceRequest], rate: float
) -> tuple[RunResult, list[tuple[StepWork, float]]]:
    """Run `trace` on the real model with memory policy `policy`; also returns every step's work
    and measured time."""
    wall = time.perf_counter()
    use_policy(engine, policy)
    recorder = RunRecorder(trace)
    paged = policy == KVPolicy.PAGED.value
    static = policy == KVPolicy.STATIC.value
    steps: list[tuple[StepWork, float]] = []
    clock, next_index, num_batches = 0.0, 0, 0
    while next_index < len(trace) or engine.has_unfinished_requests():
        while next_index < len(trace) and trace[next_index].arrival <= clock:
            req = trace[next_index]
            engine.add_request(str(next_index), list(req.prompt_token_ids), sampling_params(req), arrival_time=req.arrival)
            next_index += 1
        if not engine.has_unfinished_requests():
            clock = trace[next_index].arrival
            continue
        outputs, out, seconds = timed_step(engine)
        clock += seconds
        scheduler = engine.scheduler
        if out is not None and out.seqs:
            steps.append((step_work(out, paged), seconds))
            recorder.on_step(out, scheduler)
            if static and scheduler.num_batches != num_batches:
                num_batches = scheduler.num_batches
                for group in scheduler.current_batch:
                    recorder.batch_of[group.request_id] = num_batches
        for output in outputs:
            if output.finished:
                if output.error:
                    recorder.num_failed += 1
                else:
                    recorder.finish[output.request_id] = clock
    result = recorder.result(system, rate, engine.scheduler, "real", time.perf_counter() - wall)
    return result, steps
