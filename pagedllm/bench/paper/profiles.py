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
  at this profile.
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


A100_SCALE = Scale(max_model_len=2048, kv_slots=15_700, block_size=16, cpu_swap_slots=15_700)
CPU_SCALE = Scale(max_model_len=512, kv_slots=512, block_size=16, cpu_swap_slots=512)
# The cpu profile's step cost is measured with a larger pool, so that the calibration traces'
# batches span 1 to about 20 sequences (the model's step time does not depend on the pool size).
CALIBRATION_SCALE = Scale(max_model_len=512, kv_slots=1024, block_size=16, cpu_swap_slots=1024)
CPU_LENGTH_SCALE = {"sharegpt": 0.25, "alpaca": 1.0}

PROFILE_NAMES = ("a100-opt13b", "cpu")


def get_profile(name: str, results_dir: Path, recalibrate: bool = False) -> Profile:
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
            # Long enough that min_requests never lengthens a slow baseline's trace beyond the
            # others' (Orca-Max sustains about 0.24 req/s on ShareGPT, 0.46 on Alpaca).
            trace_seconds={"sharegpt": 240.0, "alpaca": 120.0},
            min_requests=40,
            max_requests={"sharegpt": 600, "alpaca": 600},
            rate_guess={"sharegpt": 1.0, "alpaca": 2.0},
        )
    raise ValueError(f"Unknown profile {name!r}; choose one of {', '.join(PROFILE_NAMES)}.")
