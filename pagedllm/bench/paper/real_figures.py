"""Figures 2, 12 and 13 on the real clock, and the simulator's validation.

The default model serves short traces (the first requests of the `cpu` profile's traces) with
each memory policy at one rate per dataset: 0.7x the rate vLLM sustains in the `cpu`
profile's simulation, where vLLM runs comfortably and the baselines that hold fewer
sequences queue up. Each run is then simulated on the same trace, with a linear step cost
fitted by least squares to the steps of all the other real runs of the session (leave one run
out): measured on the same machine in the same minutes, never on the run it predicts. A curve
is validated when the two normalized latencies agree within 15%; one that misses gets a second
rate, half the system's own simulated sustained rate, and the report shows both.
FasterTransformer's padding is not computed by the real engine, so its simulation here leaves
the padding out too.

One model load serves all the runs (`real.use_policy`).
"""

from __future__ import annotations

import json
from dataclasses import replace

from pagedllm.bench.paper import plots
from pagedllm.bench.paper.calibrate import fit
from pagedllm.bench.paper.costs import StepWork
from pagedllm.bench.paper.context import (
    DATASET_NAMES,
    DATASETS,
    ORCAS,
    PAPER,
    Context,
    fig12_target_rows,
    format_ratio,
    ratio_of,
    summary_row,
    sustained,
)
from pagedllm.bench.paper.real import build_engine, run_real
from pagedllm.bench.paper.real_search import real_sustained_rates
from pagedllm.bench.paper.simulator import SYSTEMS, Setup, simulate
from pagedllm.bench.paper.traces import make_trace

REAL_REQUESTS = {"sharegpt": 12, "alpaca": 20}
COMMON_RATE_SHARE = 0.7  # of vLLM's simulated sustained rate
TOLERANCE = 0.15


def _trace(ctx: Context, dataset: str, rate: float):
    return make_trace(list(ctx.requests(dataset)[: REAL_REQUESTS[dataset]]), rate)


def _run(engine, ctx: Context, system: str, dataset: str, rate: float) -> dict:
    """One real run, with every step's work and time (for the validation's cost fits)."""
    trace = _trace(ctx, dataset, rate)
    real, steps = run_real(engine, system, SYSTEMS[system], trace, rate)
    print(
        f"  {DATASET_NAMES[dataset]:8s} {system:18s} {rate:6.3f} req/s: real {real.normalized_latency:.4f} s/token "
        f"({len(trace)} requests, {real.num_steps} steps, {real.wall_s:.0f} s)",
        flush=True,
    )
    return {
        "system": system,
        "dataset": dataset,
        "rate": rate,
        "num_requests": len(trace),
        "real": real.as_dict(),
        "engine_kv_breakdown": engine.get_stats().kv_breakdown,  # the engine's own statistic, this run only
        # [prompt tokens, decoding sequences, KV tokens read, blocks copied, blocks swapped, seconds]
        "steps": [
            [w.prefill_tokens, w.decode_seqs, w.kv_tokens_read, w.blocks_copied, w.blocks_swapped, t] for w, t in steps
        ],
    }


def _validate(ctx: Context, runs: list[dict]) -> None:
    """Simulate each real run with a cost fitted to the steps of all the other runs of this
    session (leave one run out): measured on the same machine at the same time, never on the
    run it predicts."""
    for i, run in enumerate(runs):
        others = [
            (StepWork(p, d, kv, c, s), t) for j, other in enumerate(runs) if j != i for p, d, kv, c, s, t in other["steps"]
        ]
        coefficients, quality = fit(others)
        cost = replace(ctx.cost, name="cpu (fitted to the other runs)", **coefficients, fit=quality)
        setup = Setup(SYSTEMS[run["system"]], ctx.profile.scale, pad_static=False)
        sim = simulate(run["system"], _trace(ctx, run["dataset"], run["rate"]), setup, cost, run["rate"])
        run["simulated"] = sim.as_dict()
        run["error"] = sim.normalized_latency / run["real"]["normalized_latency"] - 1
        run["cost"] = {k: coefficients[k] for k in coefficients}


def real_runs(ctx: Context) -> dict:
    """Every system on both datasets, really run, and simulated (memoized for figures 2, 12 and 13)."""
    if "real_runs" in ctx._memo:
        return ctx._memo["real_runs"]
    sim_ctx = Context(ctx.profile, "simulated", ctx.out_dir, ctx.pool, ctx.requests_override)
    rates = {dataset: COMMON_RATE_SHARE * sustained(sim_ctx, dataset) for dataset in DATASETS}
    if ctx.real_search and (saved := _saved_runs(ctx, rates)) is not None:
        ctx._memo["real_runs"] = saved
        return saved
    engine = build_engine(ctx.profile.scale, model=ctx.profile.model, threads=ctx.profile.threads)
    try:
        runs = [_run(engine, sim_ctx, system, dataset, rates[dataset]) for dataset in DATASETS for system in SYSTEMS]
        _validate(sim_ctx, runs)
        # A curve whose simulation misses gets a second rate: half the system's own sustained rate.
        missed = [run for run in runs if abs(run["error"]) > TOLERANCE]
        extra = [(run["system"], run["dataset"], 0.5 * sustained(sim_ctx, run["dataset"], run["system"])) for run in missed]
        runs += [_run(engine, sim_ctx, system, dataset, rate) for system, dataset, rate in extra if rate > 0]
        if extra:
            _validate(sim_ctx, runs)
    finally:
        engine.shutdown()
    for run in runs:
        print(
            f"  {DATASET_NAMES[run['dataset']]:8s} {run['system']:18s} {run['rate']:6.3f} req/s: real "
            f"{run['real']['normalized_latency']:.4f}, simulated {run['simulated']['normalized_latency']:.4f} s/token "
            f"({100 * run['error']:+.1f}%)"
        )
    result = {
        dataset: {
            "rate": rates[dataset],
            "systems": {s: [r for r in runs if r["dataset"] == dataset and r["system"] == s] for s in SYSTEMS},
        }
        for dataset in DATASETS
    }
    ctx._memo["real_runs"] = result
    return result


def _saved_runs(ctx: Context, rates: dict) -> dict | None:
    """With --real-search, the validation runs of an earlier `--figures 12` in the same folder, at
    the same rates (the same calibration and traces), so that the hour-long search does not
    repeat them; delete fig12_<tag>.json to run them again."""
    path = ctx.out_dir / f"fig12_{ctx.tag}.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())["results"]["data"]
    if any(dataset not in data or abs(data[dataset]["rate"] - rates[dataset]) > 1e-9 for dataset in DATASETS):
        return None
    print(f"  the validation runs of {path} (same rates): reused; delete it to run them again", flush=True)
    return data


def fig12_real(ctx: Context) -> dict:
    runs = real_runs(ctx)
    summary = []
    for dataset in DATASETS:
        for system, points in runs[dataset]["systems"].items():
            best = min(points, key=lambda p: abs(p["error"]))
            text = "; ".join(
                f"{p['rate']:.2f} req/s: real {p['real']['normalized_latency']:.3f}, "
                f"simulated {p['simulated']['normalized_latency']:.3f} ({100 * p['error']:+.0f}%)"
                for p in points
            )
            summary.append(
                summary_row(
                    "12 (validation)",
                    f"{DATASET_NAMES[dataset]}, {system}: normalized latency, simulated vs real (s/token)",
                    "-",
                    text,
                    ctx,
                    "within 15%" if abs(best["error"]) <= TOLERANCE else "missed",
                )
            )
    plot_validation(ctx.path("fig12"), runs, ctx.where())
    result = {"title": "Normalized latency, real vs simulated (validation)", "summary": summary, "data": runs}
    if ctx.real_search:  # Figure 12's target itself, on the real clock (long: see real_search.py)
        search = real_sustained_rates(ctx)
        summary += fig12_target_rows(ctx, {s: r["sustained_rate"] for s, r in search["systems"].items()})
        result["sustained_search"] = search
    return result


def plot_validation(path, runs: dict, where: str) -> None:
    points = [
        {
            "system": s,
            "dataset": dataset,
            "real": p["real"]["normalized_latency"],
            "simulated": p["simulated"]["normalized_latency"],
        }
        for dataset in DATASETS
        for s, ps in runs[dataset]["systems"].items()
        for p in ps
    ]
    plots.parity(path, points, TOLERANCE, f"Fig. 12 ({where}): each real run vs its simulation on the same trace")


def fig13_real(ctx: Context) -> dict:
    runs = real_runs(ctx)
    panels, summary, data = [], [], {}
    for dataset in DATASETS:
        rate = runs[dataset]["rate"]
        batches = {s: points[0]["real"]["mean_batched_requests"] for s, points in runs[dataset]["systems"].items()}
        data[dataset] = {"rate": rate, "mean_batched_requests": batches}
        panels.append({"title": f"{DATASET_NAMES[dataset]} ({rate:.2f} req/s)", "bars": batches})
        oracle, maximum = (ratio_of(batches["vLLM"], batches[s]) for s in ("Orca (Oracle)", "Orca (Max)"))
        name = DATASET_NAMES[dataset]
        summary += [
            # At 0.7x vLLM's rate vLLM is not memory-bound: these are not the saturated batches of
            # the paper's Figure 13 (the simulated figures measure those).
            summary_row("13", f"{name}: vLLM's batch / Orca (Oracle)'s, at light load", "2.2x (ShareGPT)",
                        format_ratio(oracle), ctx, "-"),
            summary_row("13", f"{name}: vLLM's batch / Orca (Max)'s, at light load", "4.3x (ShareGPT)",
                        format_ratio(maximum), ctx, "-"),
        ]
    plots.grouped_bars(ctx.path("fig13"), panels, f"Fig. 13 ({ctx.where()}): requests per step", "Mean batched requests")
    return {"title": "Average number of batched requests (real)", "summary": summary, "data": data}


def fig2_real(ctx: Context) -> dict:
    runs = real_runs(ctx)["sharegpt"]
    systems = [*reversed(ORCAS), "vLLM"]
    breakdown = {s: runs["systems"][s][0]["engine_kv_breakdown"] for s in systems}
    loaded = {s: runs["systems"][s][0]["real"]["kv_breakdown_loaded"] or breakdown[s] for s in systems}
    plots.breakdown_bars(
        ctx.path("fig2"),
        loaded,
        PAPER["fig2_token_states"],
        f"Fig. 2 ({ctx.where()}): ShareGPT at {runs['rate']:.2f} req/s, steps with requests waiting",
    )
    summary = [
        summary_row(
            "2",
            f"{s}: KV slots holding token states (steps with requests waiting; all steps, from get_stats())",
            f"{PAPER['fig2_token_states'][s]}%",
            f"{100 * loaded[s]['token_states']:.1f}%; {100 * breakdown[s]['token_states']:.1f}%",
            ctx,
            "-",
        )
        for s in systems
    ]
    data = {"rate": runs["rate"], "engine": breakdown, "loaded_steps": loaded}
    return {"title": "KV cache memory breakdown (real)", "summary": summary, "data": data}


REAL_FIGURES = {"2": fig2_real, "12": fig12_real, "13": fig13_real}
