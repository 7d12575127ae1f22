"""Figures 2, 11, 12 and 13: the traces, and what paged memory buys with basic sampling
(normalized latency vs request rate, the KV memory breakdown, batch sizes), on the simulated
clock. Figures 2 and 13 are read past vLLM's sustained rate, where memory limits every
system's batch.
"""

from __future__ import annotations

from pagedllm.bench.paper import plots
from pagedllm.bench.paper.context import (
    DATASET_NAMES, DATASETS, ORCAS, PAPER, Context, fig12_target_rows, format_ratio, latency_panel, ratio_of, search_systems,
    summary_row, target_met, vllm_sustained,
)
from pagedllm.bench.paper.simulator import SYSTEMS, RunResult
from pagedllm.bench.paper.traces import workload

# --- Figure 12: normalized latency vs request rate, basic sampling -------------------------------


def fig12(ctx: Context) -> dict:
    panels, data, summary = [], {}, []
    for dataset in DATASETS:
        curves = {s: ctx.curve(s, dataset) for s in SYSTEMS}
        threshold, results = search_systems(ctx, curves, ctx.profile.rate_guess[dataset])
        rates = {s: r.sustained_rate for s, r in results.items()}
        for s, rate in rates.items():
            ctx._memo[("sustained", dataset, s)] = rate
        data[dataset] = {
            "trace": ctx.trace_key(dataset),
            "threshold": threshold,
            "systems": {s: r.as_dict() for s, r in results.items()},
        }
        name = DATASET_NAMES[dataset]
        panels.append(latency_panel(f"{name}: vLLM sustains {rates['vLLM']:.2f} req/s", results, threshold))
        baselines = ("Orca (Oracle)", "Orca (Max)", "FasterTransformer")
        oracle, maximum, ft = (ratio_of(rates["vLLM"], rates[s]) for s in baselines)
        if dataset == "sharegpt":
            summary += fig12_target_rows(ctx, rates)
            quantity = f"{name}: vLLM's sustained rate / FasterTransformer's"
            summary.append(summary_row("12", quantity, "up to 22x", format_ratio(ft), ctx, "-"))
        else:
            summary.append(
                summary_row(
                    "12",
                    f"{name}: vLLM's sustained rate / Orca (Oracle)'s, / Orca (Max)'s, / FT's",
                    "same trend as ShareGPT",
                    f"{format_ratio(oracle)}, {format_ratio(maximum)}, {format_ratio(ft)}",
                    ctx,
                    "-",
                )
            )
    plots.latency_curves(
        ctx.path("fig12"),
        panels,
        f"Fig. 12 ({ctx.where()}): normalized latency vs request rate; "
        "dashed: the bar a system must stay under to sustain a rate",
    )
    return {"title": "Normalized latency vs request rate, basic sampling", "summary": summary, "data": data}


# --- Figures 2 and 13: memory breakdown and batch sizes at vLLM's sustained rate ------------------


# Figures 2 and 13 are read where memory limits every system's batch: past every system's
# capacity, vLLM's included (the paper's 2 req/s on ShareGPT is near the top of vLLM's range in
# its Figure 12a). At vLLM's sustained rate itself vLLM's batch is still set by the load.
MEMORY_BOUND_SHARE = 1.25


def saturation_runs(ctx: Context, dataset: str, share: float = MEMORY_BOUND_SHARE) -> tuple[float, dict[str, RunResult]]:
    """Every system serving `dataset` at `share` x vLLM's sustained rate."""
    key = ("saturation", dataset, share)
    if key not in ctx._memo:
        rate = share * vllm_sustained(ctx, dataset)
        curves = {s: ctx.curve(s, dataset) for s in SYSTEMS}
        results = ctx.pool.runs([(curves[s], ctx.cost, rate) for s in SYSTEMS])
        ctx._memo[key] = (rate, dict(zip(SYSTEMS, results)))
    return ctx._memo[key]


def fig2(ctx: Context) -> dict:
    rate, runs = saturation_runs(ctx, "sharegpt")
    systems = [*reversed(ORCAS), "vLLM"]
    loaded = {s: runs[s].kv_breakdown_loaded or runs[s].kv_breakdown for s in systems}
    plots.breakdown_bars(
        ctx.path("fig2"),
        loaded,
        PAPER["fig2_token_states"],
        f"Fig. 2 ({ctx.where()}): KV slots by use, ShareGPT at {rate:.2f} req/s "
        f"({MEMORY_BOUND_SHARE}x vLLM's sustained rate), "
        "averaged over the steps with requests waiting",
    )
    summary = []
    for s in systems:
        ours = 100 * loaded[s]["token_states"]
        paper = PAPER["fig2_token_states"][s]
        if s == "vLLM":
            target = "met" if ours >= 96 else "missed"
        else:
            target = "met" if abs(ours - paper) <= 5 else "missed"
        summary.append(summary_row("2", f"{s}: KV slots holding token states", f"{paper}%", f"{ours:.1f}%", ctx, target))
    data = {
        "rate": rate,
        "systems": {
            s: {"loaded_steps": runs[s].kv_breakdown_loaded, "all_steps": runs[s].kv_breakdown, "run": runs[s].as_dict()}
            for s in systems
        },
    }
    return {"title": "KV cache memory breakdown", "summary": summary, "data": data}


def fig13(ctx: Context) -> dict:
    panels, data, summary = [], {}, []
    for dataset in DATASETS:
        rate, runs = saturation_runs(ctx, dataset)
        batches = {s: runs[s].mean_batched_requests for s in SYSTEMS}
        at_knee_rate, at_knee = saturation_runs(ctx, dataset, 1.0)
        knee = {s: at_knee[s].mean_batched_requests for s in SYSTEMS}
        data[dataset] = {
            "rate": rate,
            "systems": {s: runs[s].as_dict() for s in SYSTEMS},
            "at_vllm_sustained_rate": {"rate": at_knee_rate, "mean_batched_requests": knee},
        }
        paper = PAPER["fig13_sharegpt"] if dataset == "sharegpt" else {}
        panels.append({"title": f"{DATASET_NAMES[dataset]} ({rate:.2f} req/s)", "bars": batches, "paper": paper})
        if dataset == "sharegpt":
            for s in (*reversed(ORCAS), "vLLM"):
                quantity = f"ShareGPT: mean batched requests, {s}"
                summary.append(summary_row("13", quantity, f"{paper[s]:.2f}", f"{batches[s]:.2f}", ctx, "-"))
            oracle = ratio_of(batches["vLLM"], batches["Orca (Oracle)"])
            maximum = ratio_of(batches["vLLM"], batches["Orca (Max)"])
            knee_oracle = format_ratio(ratio_of(knee["vLLM"], knee["Orca (Oracle)"]))
            knee_max = format_ratio(ratio_of(knee["vLLM"], knee["Orca (Max)"]))
            knee_text = f" (at 1.0x vLLM's sustained rate, {at_knee_rate:.2f} req/s: {knee_oracle} and {knee_max})"
            summary += [
                summary_row("13", "ShareGPT: vLLM's batch / Orca (Oracle)'s", "2.2x", format_ratio(oracle) + knee_text,
                            ctx, target_met(oracle, 2.0)),
                summary_row("13", "ShareGPT: vLLM's batch / Orca (Max)'s", "4.3x", format_ratio(maximum), ctx,
                            target_met(maximum, 4.0)),
            ]
        else:
            summary.append(
                summary_row(
                    "13",
                    "Alpaca: mean batched requests, Orca Max / Pow2 / Oracle / vLLM",
                    "see the paper's Fig. 13b",
                    " / ".join(f"{batches[s]:.1f}" for s in (*reversed(ORCAS), "vLLM")),
                    ctx,
                    "-",
                )
            )
    plots.grouped_bars(
        ctx.path("fig13"),
        panels,
        f"Fig. 13 ({ctx.where()}): requests per step at {MEMORY_BOUND_SHARE}x vLLM's sustained rate "
        "(memory-bound); - = the paper",
        "Mean batched requests",
    )
    return {"title": "Average number of batched requests", "summary": summary, "data": data}


# --- Figure 11: the traces ----------------------------------------------------------------------


def fig11(ctx: Context) -> dict:
    histograms, data, summary = {}, {}, []
    scale = ctx.profile.scale
    for dataset in DATASETS:
        length_scale = ctx.profile.length_scale[dataset]
        requests = workload(dataset, ctx.requests_override or 5000, scale.max_model_len, length_scale, seed=11)
        inputs = [len(p) for p, _ in requests]
        outputs = [o for _, o in requests]
        means = (sum(inputs) / len(inputs), sum(outputs) / len(outputs))
        histograms[f"{DATASET_NAMES[dataset]} (x{length_scale:g})"] = {"input": inputs, "output": outputs}
        data[dataset] = {"length_scale": ctx.profile.length_scale[dataset], "mean_input": means[0], "mean_output": means[1]}
        paper = PAPER["fig11_means"][dataset]
        scaled = ctx.profile.length_scale[dataset]
        summary.append(
            summary_row(
                "11",
                f"{DATASET_NAMES[dataset]}: mean input / output tokens" + (f" (lengths x{scaled:g})" if scaled != 1 else ""),
                f"{paper[0]} / {paper[1]}",
                f"{means[0]:.1f} / {means[1]:.1f}",
                ctx,
                "-",
            )
        )
    caption = f"Fig. 11 ({ctx.profile.name} lengths): the traces, {len(inputs)} requests each"
    plots.length_histograms(ctx.path("fig11"), histograms, caption)
    return {"title": "Input and output lengths of the traces", "summary": summary, "data": data}
