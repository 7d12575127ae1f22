"""Figure 12's target on the real clock: the rate each system sustains, searched with real runs.

The target for Figure 12 (the paper's ratios, docs/paper.md) holds "simulated at the paper's scale and real on
the CPU": the rate vLLM sustains at twice its unloaded normalized latency is >= 1.7x Orca (Oracle)'s and
>= 2.7x Orca (Max)'s. Here the profile's model really serves the profile's ShareGPT curves (the same
requests, arrivals and trace durations as the simulated Figure 12) for all five systems: vLLM, the
three Orcas and static batching (FasterTransformer's policy; the real engine computes no padding, so
its simulated start leaves padding out too). The bar is twice vLLM's real unloaded normalized latency
(40 requests that never overlap; idle time costs nothing on the real clock). Each system's search is
`search.sustained_rate` with real runs in place of simulated ones, started at the rate the
simulation found for that system and stepping by 1.25x until the bar is crossed, without refinement
or light-load point: two runs per system when the simulation is right within 1.25x, and the
sustained rate interpolated inside that bracket (normalized latency linear in log rate).

Cost: a run near a system's sustained rate keeps the CPU busy for about the trace's duration (240 s
of ShareGPT arrivals, or min_requests / rate for the slow systems) plus its drain: about 45 minutes
for the five systems of the cpu profile, about an hour for cpu-1b (`pagedllm bench paper --clock
real [--profile cpu-1b] --figures 12 --real-search`, on a quiet machine).
"""

from __future__ import annotations

import json
from functools import partial

from pagedllm.bench.paper.context import Context, sustained, unloaded_latency
from pagedllm.bench.paper.real import build_engine, run_real
from pagedllm.bench.paper.search import Curve, sustained_rate, trace_at
from pagedllm.bench.paper.simulator import SYSTEMS, RunResult

# Figure 12's targets first (vLLM against Orca (Oracle) and (Max)), the slowest runs last.
SEARCHED = ("vLLM", "Orca (Oracle)", "Orca (Max)", "Orca (Pow2)", "FasterTransformer")
assert set(SEARCHED) == set(SYSTEMS)
FACTOR = 1.25
REFINEMENTS = 0


def real_run_at(engine, curve: Curve, rate: float) -> RunResult:
    """`curve` at `rate` on the real clock: the requests and arrivals its simulation serves."""
    result, _ = run_real(engine, curve.system, curve.setup.policy, trace_at(curve, rate), rate)
    print(
        f"  {curve.system:18s} {rate:6.3f} req/s: real {result.normalized_latency:.4f} s/token "
        f"({result.num_requests} requests, {result.wall_s:.0f} s)",
        flush=True,
    )
    return result


def real_sustained_rates(ctx: Context, dataset: str = "sharegpt") -> dict:
    """Each searched system's sustained rate on the real clock, with its simulated one."""
    sim_ctx = Context(ctx.profile, "simulated", ctx.out_dir, ctx.pool, ctx.requests_override)
    curves = {s: sim_ctx.curve(s, dataset, pad_static=False) for s in SEARCHED}
    simulated = {s: sustained(sim_ctx, dataset, s) for s in SEARCHED}
    # Figure 12 prices static batching's padding; the real engine computes none: simulate it without.
    sim_threshold = 2 * unloaded_latency(sim_ctx, curves["vLLM"])
    simulated["FasterTransformer"] = sustained_rate(
        curves["FasterTransformer"], ctx.cost, sim_threshold, simulated["FasterTransformer"]
    ).sustained_rate
    engine = build_engine(ctx.profile.scale, model=ctx.profile.model, threads=ctx.profile.threads)
    try:
        run = partial(real_run_at, engine)
        threshold = 2 * unloaded_latency(sim_ctx, curves["vLLM"], run)
        results = {}
        for s in SEARCHED:
            results[s] = sustained_rate(
                curves[s], None, threshold, simulated[s], FACTOR, REFINEMENTS, run=run, light_load_point=False
            )
            print(f"  {s}: sustains {results[s].sustained_rate:.3f} req/s on the real clock "
                  f"(simulated {simulated[s]:.3f})", flush=True)
            # Each system's answer as soon as it is known: the whole search takes about an hour.
            answer = {"dataset": dataset, "threshold": threshold, "simulated_rates": simulated,
                      "systems": {name: r.as_dict() for name, r in results.items()}}
            (ctx.out_dir / f"real_search_{ctx.tag}.json").write_text(json.dumps(answer, indent=1))
    finally:
        engine.shutdown()
    return answer
