"""Figures 14, 15, 16, 18b and 19 on the simulated clock: parallel sampling and beam search,
the memory saved by sharing blocks, a shared prefix, block size, and swapping vs
recomputation. Each runs at (a share of) vLLM's sustained rate from Figure 12.
"""

from __future__ import annotations

from pagedllm.bench.paper import plots
from pagedllm.bench.paper.context import (
    DATASET_NAMES, DATASETS, PAPER, Context, format_ratio, latency_panel, ratio_of, search_systems, summary_row,
    sustained, vllm_sustained,
)
from pagedllm.bench.paper.costs import StepWork
from pagedllm.bench.paper.search import Curve
from pagedllm.bench.paper.simulator import Setup
from pagedllm.bench.paper.traces import PREFIX_TOKENS, prefix_workload

# --- Figures 14 and 15: parallel sampling and beam search ---------------------------------------

DECODING = (("parallel", 2), ("parallel", 4), ("parallel", 6), ("beam", 2), ("beam", 4), ("beam", 6))
FIG14_SYSTEMS = ("vLLM", "Orca (Oracle)", "Orca (Max)")


def _decoding_curve(ctx: Context, system: str, dataset: str, method: str, width: int, divisor: int, **kw) -> Curve:
    curve = ctx.curve(system, dataset, divisor, preemption_mode="auto")
    extra = {"n": width} if method == "parallel" else {"beam_width": width}
    return Curve(**{**curve.__dict__, **extra, **kw})


def fig14(ctx: Context) -> dict:
    panels, data, summary = [], {}, []
    basic = sustained(ctx, "alpaca")  # vLLM's rate with one sequence per request
    # Half the usual trace duration (still the same for every system, so no one is favoured):
    # a request here is up to six sequences long.
    seconds = ctx.trace_seconds("alpaca") / 2 if ctx.trace_seconds("alpaca") else None
    for method, width in DECODING:
        curves = {
            s: _decoding_curve(ctx, s, "alpaca", method, width, divisor=1, trace_seconds=seconds) for s in FIG14_SYSTEMS
        }
        # Max holds one or two requests of several maximum-length sequences: start it low.
        threshold, results = search_systems(ctx, curves, basic / width, shares={"Orca (Max)": 0.1 / width})
        rates = {s: r.sustained_rate for s, r in results.items()}
        label = f"{'parallel n' if method == 'parallel' else 'beam width'}={width}"
        data[label] = {"threshold": threshold, "systems": {s: r.as_dict() for s, r in results.items()}}
        panels.append(latency_panel(f"Alpaca, {label}", results, threshold))
        summary.append(
            summary_row(
                "14",
                f"Alpaca, {label}: vLLM's sustained rate / Orca (Oracle)'s (/ Orca (Max)'s)",
                "grows from 1.3x (basic sampling) to 2.3x (beam width 6)" if (method, width) == ("beam", 6) else "-",
                f"{format_ratio(ratio_of(rates['vLLM'], rates['Orca (Oracle)']))} "
                f"({format_ratio(ratio_of(rates['vLLM'], rates['Orca (Max)']))})",
                ctx,
                "-",
            )
        )
    base = ratio_of(basic, sustained(ctx, "alpaca", "Orca (Oracle)"))
    quantity = "Alpaca, basic sampling (Fig. 12): vLLM's sustained rate / Orca (Oracle)'s"
    summary.insert(0, summary_row("14", quantity, "1.3x", format_ratio(base), ctx, "-"))
    plots.latency_curves(ctx.path("fig14"), panels, f"Fig. 14 ({ctx.where()}): parallel sampling and beam search on Alpaca")
    return {"title": "Parallel sampling and beam search", "summary": summary, "data": data}


def fig15(ctx: Context) -> dict:
    tasks, keys = [], []
    for dataset in DATASETS:
        base = vllm_sustained(ctx, dataset)
        for method, width in DECODING:
            # ShareGPT beams are long: a third of the trace keeps the run short.
            curve = _decoding_curve(ctx, "vLLM", dataset, method, width, divisor=3, track_sharing=True)
            tasks.append((curve, ctx.cost, 0.5 * base / width))
            keys.append((dataset, method, width))
    runs = dict(zip(keys, ctx.pool.runs(tasks)))
    panels, data, summary = [], {}, []
    for dataset in DATASETS:
        bars = {}
        for method, width in DECODING:
            run = runs[(dataset, method, width)]
            label = f"{'parallel' if method == 'parallel' else 'beam'} {width}"
            bars[label] = 100 * run.sharing_saving
            data.setdefault(dataset, {})[label] = run.as_dict()
        panels.append({"title": f"{DATASET_NAMES[dataset]}: KV blocks saved by sharing", "bars": bars})
        for method in ("parallel", "beam"):
            paper = PAPER["fig15_saving"][(dataset, method)]
            ours = [bars[f"{method} {w}"] for w in (2, 4, 6)]
            summary.append(
                summary_row(
                    "15",
                    f"{DATASET_NAMES[dataset]}: memory saved by sharing, "
                    f"{'parallel sampling' if method == 'parallel' else 'beam search'} (2/4/6)",
                    f"{paper[0]}-{paper[1]}%",
                    " / ".join(f"{v:.1f}%" for v in ours),
                    ctx,
                    "-",
                )
            )
    caption = f"Fig. 15 ({ctx.where()}): blocks saved by sharing / blocks without sharing"
    plots.grouped_bars(ctx.path("fig15"), panels, caption, "Memory saving (%)")
    return {"title": "Memory saved by sharing KV blocks", "summary": summary, "data": data}


# --- Figure 16: shared prefix -------------------------------------------------------------------


def fig16(ctx: Context) -> dict:
    panels, data, summary = [], {}, []
    for shots in (1, 5):
        requests = tuple(prefix_workload(shots, ctx.num_requests("alpaca"), ctx.profile.length_scale["alpaca"]))
        seconds, least = ctx.trace_seconds("alpaca"), ctx.profile.min_requests
        curves = {
            "vLLM": Curve("vLLM", Setup("paged", ctx.profile.scale, enable_prefix_caching=True), requests, seconds, least),
            "Orca (Oracle)": Curve("Orca (Oracle)", Setup("orca-oracle", ctx.profile.scale), requests, seconds, least),
        }
        threshold, results = search_systems(ctx, curves, ctx.profile.rate_guess["alpaca"])
        rates = {s: r.sustained_rate for s, r in results.items()}
        speedup = ratio_of(rates["vLLM"], rates["Orca (Oracle)"])
        prefix_tokens = round(PREFIX_TOKENS[shots] * ctx.profile.length_scale["alpaca"])
        systems = {s: r.as_dict() for s, r in results.items()}
        data[f"{shots}-shot"] = {"prefix_tokens": prefix_tokens, "threshold": threshold, "systems": systems}
        panels.append(latency_panel(f"{shots}-shot prefix", results, threshold))
        paper = PAPER["fig16_speedup"][shots]
        summary.append(
            summary_row("16", f"{shots}-shot shared prefix: vLLM's sustained rate / Orca (Oracle)'s", f"{paper}x",
                        format_ratio(speedup), ctx, "-")
        )
    caption = f"Fig. 16 ({ctx.where()}): translation with a shared few-shot prefix (vLLM caches it)"
    plots.latency_curves(ctx.path("fig16"), panels, caption)
    return {"title": "Shared prefix", "summary": summary, "data": data}


# --- Figures 18b and 19: block size, swapping vs recomputation ----------------------------------

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _relative(latencies: dict[int, float]) -> str:
    """Each block size's latency relative to the lowest, in words."""
    best = min(latencies, key=latencies.get)
    others = ", ".join(
        f"{bs} {100 * (latency / latencies[best] - 1):+.0f}%" for bs, latency in sorted(latencies.items()) if bs != best
    )
    return f"lowest at {best} (others: {others})"


def fig18(ctx: Context) -> dict:
    tasks, keys = [], []
    for dataset in DATASETS:
        rate = vllm_sustained(ctx, dataset)
        for bs in BLOCK_SIZES:
            tasks.append((ctx.curve("vLLM", dataset, 2, block_size=bs), ctx.cost, rate))
            keys.append((dataset, bs))
    runs = dict(zip(keys, ctx.pool.runs(tasks)))
    series, data, summary = {}, {}, []
    for dataset in DATASETS:
        latencies = {bs: runs[(dataset, bs)].normalized_latency for bs in BLOCK_SIZES}
        series[DATASET_NAMES[dataset]] = list(latencies.items())
        data[dataset] = {"rate": runs[(dataset, 16)].rate, "runs": {bs: runs[(dataset, bs)].as_dict() for bs in BLOCK_SIZES}}
        paper = "best at 16-128" if dataset == "sharegpt" else "best at 16-32"
        quantity = f"{DATASET_NAMES[dataset]}: normalized latency by block size"
        summary.append(summary_row("18b", quantity, paper, _relative(latencies), ctx, "-"))
    plots.lines(
        ctx.path("fig18b"),
        [
            {"title": "vLLM at its sustained rate", "xlabel": "Block size", "ylabel": "Normalized latency (s/token)",
             "series": series, "logx": True}
        ],
        f"Fig. 18b ({ctx.where()}): end-to-end latency vs block size",
    )
    return {"title": "Latency vs block size", "summary": summary, "data": data}


def fig19(ctx: Context) -> dict:
    # (a) the microbenchmark: moving the KV of 1024 tokens out and back, or recomputing them.
    tokens = 1024
    micro = {"swap out": [], "swap in": [], "swap in + out": [], "recompute": []}
    for bs in BLOCK_SIZES:
        cost = ctx.cost.with_block_size(bs)
        one_way = cost.swap_seconds_per_block() / 2 * (tokens // bs)
        micro["swap out"].append((bs, 1e3 * one_way))
        micro["swap in"].append((bs, 1e3 * one_way))
        micro["swap in + out"].append((bs, 2e3 * one_way))
        prefill = cost.step_seconds(StepWork(prefill_tokens=tokens, kv_tokens_read=tokens)) - cost.step_seconds(StepWork())
        micro["recompute"].append((bs, 1e3 * prefill))
    # (b) end to end: vLLM past its sustained rate, so that it preempts, with each mode.
    rate = 1.25 * vllm_sustained(ctx, "sharegpt")
    tasks, keys = [], []
    for mode in ("recompute", "swap"):
        for bs in BLOCK_SIZES:
            tasks.append((ctx.curve("vLLM", "sharegpt", 2, block_size=bs, preemption_mode=mode), ctx.cost, rate))
            keys.append((mode, bs))
    runs = dict(zip(keys, ctx.pool.runs(tasks)))
    end_to_end = {mode: [(bs, runs[(mode, bs)].normalized_latency) for bs in BLOCK_SIZES] for mode in ("recompute", "swap")}
    ratio = {bs: runs[("swap", bs)].normalized_latency / runs[("recompute", bs)].normalized_latency for bs in BLOCK_SIZES}
    plots.lines(
        ctx.path("fig19"),
        [
            {"title": f"(a) KV of {tokens} tokens", "xlabel": "Block size", "ylabel": "Time (ms)", "series": micro,
             "logx": True, "logy": True},
            {"title": f"(b) ShareGPT at {rate:.2f} req/s", "xlabel": "Block size", "ylabel": "Normalized latency (s/token)",
             "series": end_to_end, "logx": True},
        ],
        f"Fig. 19 ({ctx.where()}): swapping vs recomputation",
    )
    micro_ratio = ", ".join(
        f"{bs}: {swap / recompute:.2g}x" for (bs, swap), (_, recompute) in zip(micro["swap in + out"], micro["recompute"])
    )
    summary = [
        summary_row("19", "microbenchmark: swap in+out time / recompute time, by block size",
                    "swap far slower at small blocks", micro_ratio, ctx, "-"),
        summary_row(
            "19",
            "end to end: swap's normalized latency / recompute's, by block size",
            "comparable at 16-64",
            ", ".join(f"{bs}: {r:.2f}" for bs, r in ratio.items()),
            ctx,
            "-",
        ),
    ]
    data = {
        "tokens": tokens,
        "microbenchmark_ms": micro,
        "rate": rate,
        "end_to_end": {mode: {bs: runs[(mode, bs)].as_dict() for bs in BLOCK_SIZES} for mode in ("recompute", "swap")},
    }
    return {"title": "Swapping vs recomputation", "summary": summary, "data": data}
