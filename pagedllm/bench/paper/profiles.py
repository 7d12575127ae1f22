"""The named settings `pagedllm bench paper --profile NAME` runs at: the serving setup (context,
KV slots, block size), how trace lengths are scaled, trace sizes, and the step cost.

- `a100-opt13b`: the paper's own setting (OPT-13B on one A100-40GB, Table 1: 15.7K KV slots,
  contexts of 2048 tokens), priced by the roofline `costs.A100_OPT13B`. Simulated only.
- `cpu`: this machine with the default model on one thread, priced by the linear model fitted
  to its timed steps (`calibrate.py`). Contexts of 512 tokens and 1024 KV slots: ShareGPT
  lengths are scaled by 1/4, Alpaca's fit unscaled; the budget holds two maximum-length
  reservations (Orca-Max's batch) and 10-20 paged sequences, so memory limits the baselines as
  on the GPU. The real clock runs at this profile.
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
CPU_SCALE = Scale(max_model_len=512, kv_slots=1024, block_size=16, cpu_swap_slots=1024)
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

        cost = load_or_calibrate(CPU_SCALE, CPU_LENGTH_SCALE, results_dir, recalibrate)
        return Profile(
            name=name,
            description="the default model on one thread of this CPU: 1024 KV slots, contexts of 512 tokens "
            "(ShareGPT lengths x1/4, Alpaca x1); step cost fitted to timed steps of the real model",
            scale=CPU_SCALE,
            cost=cost,
            length_scale=CPU_LENGTH_SCALE,
            trace_seconds={"sharegpt": 60.0, "alpaca": 30.0},
            min_requests=40,
            max_requests={"sharegpt": 600, "alpaca": 600},
            rate_guess={"sharegpt": 1.0, "alpaca": 2.0},
        )
    raise ValueError(f"Unknown profile {name!r}; choose one of {', '.join(PROFILE_NAMES)}.")
