"""The named settings `pagedllm bench paper --profile NAME` runs at: the serving setup (context,
KV slots, block size), how trace lengths are scaled, trace sizes, and the step cost.

- `a100-opt13b`: the paper's own setting (OPT-13B on one A100-40GB, Table 1: 15.7K KV slots,
  contexts of 2048 tokens), priced by the roofline `costs.A100_OPT13B`. Simulated only.
- `cpu`: this machine with the default model on one thread, priced by the linear model fitted
  to its timed steps (`calibrate.py`). Contexts of 512 tokens, ShareGPT lengths scaled by 1/4,
  Alpaca's unscaled. The KV budget is what makes memory the limit, as on the GPU: a CPU step
  costs about 27 ms plus 6 ms per decoding sequence, so twice the unloaded latency is reached
  at about 3.5 requests in flight even with unbounded memory (an A100 step is nearly flat in
  the batch). 512 slots, the smallest pool that holds one maximum-length sequence, keep vLLM at
  about 70% of the ShareGPT rate it sustains with unbounded memory (the a100-opt13b profile:
  61%); 1024 slots left it at 96%, bound by the CPU rather than by memory. The real clock runs
  at this profile by default.
- `cpu-1b`: a 1B-class model (`--model`, default the benchmark's random-weight Llama-3.2-1B
  Q4_K_M, `benchmarks/make_gguf_models.py`) on two threads, where a decode step reads ~0.6 GB of
  quantized weights whatever the batch, so the step is nearly flat in the batch up to a few dozen
  sequences, as an A100's is: the regime in which paged memory's larger batches become
  throughput. Contexts of 1024 tokens, ShareGPT lengths x1/2, Alpaca x1; the KV budget
  (`--kv-slots`, default 1024 slots = 64 MiB of float32 KV for Llama-3.2-1B's 16 layers of 8 KV
  heads) is chosen by the cpu profile's rule: the smallest pool that holds one maximum-length
  sequence, so that memory limits vLLM as much as it can. `benchmarks/paper_kv_budget.py` shows
  vLLM's simulated ShareGPT rate at each budget against unbounded memory: on 2 threads of a
  Zen 4 EPYC (2026-12-05) 86% at 1024 slots and 100% at 2048 (the CPU binds first there; the
  default was 2048 until then, 91% on the AMX Xeon of 2026-12-03). Its step cost is calibrated on
  that model (`calibrate.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pagedllm.bench.paper.costs import A100_OPT13B, LinearCost, RooflineCost, Scale


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    scale: Scale
    cost: RooflineCost | LinearCost
    length_scale: dict[str, float] = field(default_factory=lambda: {"sharegpt": 1.0, "alpaca": 1.0})
    # How long a trace lasts, per dataset: a run at rate r serves r x trace_seconds requests
    # (within min_requests and max_requests). A fixed duration, rather than a fixed count, makes
    # latency explode at the same multiple of each system's capacity: with a fixed count a fast
    # system's trace ends before its queue has grown, flattering it.
    trace_seconds: dict[str, float] = field(default_factory=lambda: {"sharegpt": 120.0, "alpaca": 20.0})
    min_requests: int = 60
    max_requests: dict[str, int] = field(default_factory=lambda: {"sharegpt": 1500, "alpaca": 3000})
    # Where the search for vLLM's sustainable rate starts (req/s).
    rate_guess: dict[str, float] = field(default_factory=lambda: {"sharegpt": 3.0, "alpaca": 60.0})
    # The real clock's model (None: the embedded default) and torch threads.
    model: str | None = None
    threads: int = 1


A100_SCALE = Scale(max_model_len=2048, kv_slots=15_700, block_size=16, cpu_swap_slots=15_700)
CPU_SCALE = Scale(max_model_len=512, kv_slots=512, block_size=16, cpu_swap_slots=512)
# The cpu profile's step cost is measured with a larger pool, so that the calibration traces'
# batches span 1 to about 20 sequences (the model's step time does not depend on the pool size).
CALIBRATION_SCALE = Scale(max_model_len=512, kv_slots=1024, block_size=16, cpu_swap_slots=1024)
CPU_LENGTH_SCALE = {"sharegpt": 0.25, "alpaca": 1.0}
# The CPU profiles' trace sizes: long enough that min_requests never lengthens a slow baseline's
# trace beyond the others' (on the cpu profile Orca-Max sustains about 0.24 req/s on ShareGPT,
# 0.46 on Alpaca).
CPU_TRACES = dict(trace_seconds={"sharegpt": 240.0, "alpaca": 120.0}, min_requests=40,
                  max_requests={"sharegpt": 600, "alpaca": 600})
CPU_1B_SLOTS = 1024
CPU_1B_LENGTH_SCALE = {"sharegpt": 0.5, "alpaca": 1.0}
CPU_1B_THREADS = 2
# The benchmark's 1B model (benchmarks/make_gguf_models.py writes it).
CPU_1B_MODEL = Path.home() / ".cache" / "pagedllm" / "gguf-models" / "1b-q4_k_m.gguf"

PROFILE_NAMES = ("a100-opt13b", "cpu", "cpu-1b")


def cpu_1b_scale(kv_slots: int = CPU_1B_SLOTS) -> Scale:
    return Scale(max_model_len=1024, kv_slots=kv_slots, block_size=16, cpu_swap_slots=kv_slots)


def get_profile(name: str, results_dir: Path, recalibrate: bool = False, model: str | None = None,
                kv_slots: int | None = None, threads: int | None = None) -> Profile:
    if name != "cpu-1b" and (model or kv_slots or threads):
        raise ValueError(f"--model, --kv-slots and --threads set up the cpu-1b profile, not {name!r}: "
                         "add --profile cpu-1b or leave them out.")
    if name == "a100-opt13b":
        return Profile(
            name=name,
            description="OPT-13B on one A100-40GB (the paper's Table 1): 15.7K KV slots, contexts of 2048 tokens; "
            "step cost from a roofline",
            scale=A100_SCALE,
            cost=A100_OPT13B,
        )
    if name == "cpu":
        from pagedllm.bench.paper.calibrate import load_or_calibrate

        cost = load_or_calibrate(CALIBRATION_SCALE, CPU_LENGTH_SCALE, results_dir, recalibrate)
        return Profile(
            name=name,
            description="the default model on one thread of this CPU: 512 KV slots, contexts of 512 tokens "
            "(ShareGPT lengths x1/4, Alpaca x1); step cost fitted to timed steps of the real model",
            scale=CPU_SCALE,
            cost=cost,
            length_scale=CPU_LENGTH_SCALE,
            rate_guess={"sharegpt": 1.0, "alpaca": 2.0},
            **CPU_TRACES,
        )
    if name == "cpu-1b":
        from pagedllm.bench.paper.calibrate import load_or_calibrate

        model = str(model or CPU_1B_MODEL)
        if not Path(model).exists():
            raise ValueError(f"The cpu-1b profile's model {model} does not exist: write it with "
                             "`python benchmarks/make_gguf_models.py` or pass --model PATH.")
        if kv_slots is not None and (kv_slots < 1024 or kv_slots % 16):
            raise ValueError(f"--kv-slots must be a multiple of 16 of at least 1024 (one full-length sequence), "
                             f"got {kv_slots}.")
        threads = threads or CPU_1B_THREADS
        kv_slots = kv_slots or CPU_1B_SLOTS
        # Calibrated at twice the budget, so that the calibration's batches span more sizes.
        calibration = cpu_1b_scale(2 * kv_slots)
        cost = load_or_calibrate(calibration, CPU_1B_LENGTH_SCALE, results_dir, recalibrate, name, model, threads)
        return cpu_1b_profile(cost, kv_slots, model, threads)
    raise ValueError(f"Unknown profile {name!r}; choose one of {', '.join(PROFILE_NAMES)}.")


def cpu_1b_profile(cost: LinearCost, kv_slots: int = CPU_1B_SLOTS, model: str = str(CPU_1B_MODEL),
                   threads: int = CPU_1B_THREADS) -> Profile:
    """The cpu-1b profile at `kv_slots`, priced by `cost` (its calibration on `model`)."""
    scale = cpu_1b_scale(kv_slots)
    return Profile(
        name="cpu-1b",
        description=f"{Path(model).name} on {threads} threads of this CPU: {scale.kv_slots} KV slots, contexts of "
        "1024 tokens (ShareGPT lengths x1/2, Alpaca x1); step cost fitted to timed steps of that model",
        scale=scale,
        cost=cost,
        length_scale=CPU_1B_LENGTH_SCALE,
        rate_guess={"sharegpt": 0.5, "alpaca": 1.0},
        **CPU_TRACES,
        model=model,
        threads=threads,
    )
