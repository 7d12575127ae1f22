"""Figure 12's target on the real clock: the rate each system sustains, searched with real runs.

The target for Figure 12 (the paper's ratios, docs/paper.md) holds "simulated at the paper's scale and real on
the CPU": the rate vLLM sustains at twice its unloaded normalized latency is >= 1.7x Orca (Oracle)'s and
>= 2.7x Orca (Max)'s. Here the default model really serves the `cpu` profile's ShareGPT curves
(the same requests, arrivals and trace durations as the simulated Figure 12). The bar is twice
vLLM's real unloaded normalized latency (40 requests that never overlap; idle time costs
nothing on the real clock). Each system's search is `search.sustained_rate` with real runs in
place of simulated ones, started at the rate the simulation found for that system, stepping by
1.25x and halving the bracket once, without the light-load point: three or four runs per
system.

Cost: a run near a system's sustained rate keeps the one thread busy for about the trace's
duration (240 s of ShareGPT arrivals) plus its drain, so vLLM, Orca (Oracle) and Orca (Max)
take about 45 minutes together, plus 2 for the unloaded runs (`pagedllm bench paper --clock
real --figures 12 --real-search`, on a quiet machine).
"""

from __future__ import annotations

from functools import partial

from pagedllm.bench.paper.context import Context, sustained, unloaded_latency
from pagedllm.bench.paper.real import build_engine, run_real
from pagedllm.bench.paper.search import Curve, sustained_rate, trace_at
from pagedllm.bench.paper.simulator import RunResult

SEARCHED = ("vLLM", "Orca (Oracle)", "Orca (Max)")
FACTOR = 1.25
REFINEMENTS = 1


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
    curves = {s: sim_ctx.curve(s, dataset) for s in SEARCHED}
    simulated = {s: sustained(sim_ctx, dataset, s) for s in SEARCHED}
    engine = build_engine(ctx.profile.scale, model=ctx.profile.model, threads=ctx.profile.threads)
    try:
        run = partial(real_run_at, engine)
        threshold = 2 * unloaded_latency(sim_ctx, curves["vLLM"], run)
        results = {
            s: sustained_rate(
                curves[s], None, threshold, simulated[s], FACTOR, REFINEMENTS, run=run, light_load_point=False
            )
            for s in SEARCHED
        }
    finally:
        engine.shutdown()
    return {
        "dataset": dataset,
        "threshold": threshold,
        "simulated_rates": simulated,
        "systems": {s: r.as_dict() for s, r in results.items()},
    }
