"""What every figure of the paper's evaluation shares: the `Context` a run carries (profile,
clock, output folder, process pool, memoized traces and rates), the paper's numbers, and the
helpers that find sustained rates and write a figure's summary rows.

A system's sustained rate is the highest Poisson rate at which its normalized latency stays
under twice vLLM's unloaded normalized latency (the same bar for every system). Figure 12
searches it for every system; the other figures read it back (`sustained`), from this run's
memo or from Figure 12's JSON of an earlier run at the same profile and trace size.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pagedllm.bench.paper.costs import StepWork
from pagedllm.bench.paper.profiles import Profile
from pagedllm.bench.paper.search import Curve, Pool, SearchResult, run_at, sustained_rate
from pagedllm.bench.paper.simulator import SYSTEMS, RunResult, Setup
from pagedllm.bench.paper.traces import workload

DATASETS = ("sharegpt", "alpaca")
DATASET_NAMES = {"sharegpt": "ShareGPT", "alpaca": "Alpaca"}
ORCAS = ("Orca (Oracle)", "Orca (Pow2)", "Orca (Max)")
# Where each system's search starts, as a share of vLLM's expected rate (the searches run in
# parallel, so they cannot wait for vLLM's answer).
START_SHARE = {"vLLM": 1.0, "Orca (Oracle)": 0.6, "Orca (Pow2)": 0.45, "Orca (Max)": 0.3, "FasterTransformer": 0.08}

# The paper's numbers (OPT-13B on one A100 unless said).
PAPER = {
    "fig2_token_states": {"Orca (Max)": 20.4, "Orca (Pow2)": 26.8, "Orca (Oracle)": 38.2, "vLLM": 96.3},
    "fig11_means": {"sharegpt": (161.31, 337.99), "alpaca": (19.31, 58.45)},
    "fig13_sharegpt": {"Orca (Max)": 7.00, "Orca (Pow2)": 9.81, "Orca (Oracle)": 13.62, "vLLM": 30.42},
    "fig15_saving": {
        ("alpaca", "parallel"): (6.1, 9.8),
        ("alpaca", "beam"): (37.6, 55.2),
        ("sharegpt", "parallel"): (16.2, 30.5),
        ("sharegpt", "beam"): (44.3, 66.3),
    },
    "fig16_speedup": {1: 1.67, 5: 3.58},
}


@dataclass
class Context:
    profile: Profile
    clock: str  # "simulated" or "real"
    out_dir: Path
    pool: Pool
    requests_override: int | None = None  # tiny traces, for tests
    real_search: bool = False  # real clock: also search sustained rates (Fig. 12's target; long)
    _memo: dict = field(default_factory=dict)

    @property
    def tag(self) -> str:
        if self.clock == "real":  # the default model's real runs keep their old name
            return "real" if self.profile.name == "cpu" else f"real-{self.profile.name}"
        return self.profile.name

    @property
    def cost(self):
        return self.profile.cost

    def where(self) -> str:
        """Which clock and profile produced a figure, in words."""
        if self.clock == "real":
            if self.profile.model is None:
                return "real clock (the default model run on this CPU)"
            return f"real clock ({Path(self.profile.model).name} on {self.profile.threads} threads of this CPU)"
        return f"simulated clock, profile {self.profile.name}"

    def num_requests(self, dataset: str, divisor: int = 1) -> int:
        """Requests in the workload a curve draws its traces from."""
        return self.requests_override or max(20, self.profile.max_requests[dataset] // divisor)

    def trace_key(self, dataset: str) -> dict:
        return {"max_requests": self.num_requests(dataset), "trace_seconds": self.trace_seconds(dataset)}

    def trace_seconds(self, dataset: str) -> float | None:
        return None if self.requests_override else self.profile.trace_seconds[dataset]

    def requests(self, dataset: str, divisor: int = 1) -> tuple:
        key = ("requests", dataset, divisor)
        if key not in self._memo:
            scale = self.profile.scale
            length_scale = self.profile.length_scale[dataset]
            self._memo[key] = tuple(workload(dataset, self.num_requests(dataset, divisor), scale.max_model_len, length_scale))
        return self._memo[key]

    def curve(self, system: str, dataset: str, divisor: int = 1, **setup) -> Curve:
        return Curve(
            system,
            Setup(SYSTEMS[system], self.profile.scale, **setup),
            self.requests(dataset, divisor),
            self.trace_seconds(dataset),
            self.profile.min_requests,
        )

    def path(self, name: str) -> Path:
        return self.out_dir / f"{name}_{self.tag}.png"


def unloaded_latency(ctx: Context, curve: Curve, run: Callable[[Curve, float], RunResult] | None = None) -> float:
    """Normalized latency with requests (almost) never overlapping: a few dozen of them at a
    rate far below what one request alone takes to serve. `run(curve, rate)` runs them
    (default: simulated)."""
    requests = curve.requests[:40]
    mean_out = sum(out for _, out in requests) / len(requests)
    width = max(curve.n, curve.beam_width, 1)
    one_step = StepWork(decode_seqs=width, kv_tokens_read=width * 256)
    service = mean_out * ctx.cost.with_block_size(curve.setup.bs).step_seconds(one_step)
    alone = Curve(**{**curve.__dict__, "requests": requests, "trace_seconds": None})
    run = run or (lambda c, rate: run_at(c, ctx.cost, rate))
    return run(alone, 0.02 / service).normalized_latency


def search_systems(
    ctx: Context, curves: dict[str, Curve], guess: float, refinements: int = 2, shares: dict[str, float] | None = None
) -> tuple[float, dict[str, SearchResult]]:
    """Every system's sustained rate at one threshold: twice vLLM's unloaded latency. Each
    search starts at `guess` (vLLM's expected rate) times the system's share."""
    threshold = 2 * unloaded_latency(ctx, curves["vLLM"])
    shares = {**START_SHARE, **(shares or {})}
    names = sorted(curves, key=lambda s: shares[s])  # the slowest searches start first
    tasks = [(curves[s], ctx.cost, threshold, guess * shares[s], 1.6, refinements) for s in names]
    results = dict(zip(names, ctx.pool.searches(tasks)))
    return threshold, {s: results[s] for s in curves}


def ratio_of(a: float, b: float) -> float | None:
    return a / b if b else None


def format_ratio(value: float | None) -> str:
    if value is None:
        return "unbounded (the baseline never meets the bar)"
    return f"{value:.2f}x"


def target_met(value: float | None, bar: float) -> str:
    if value is None:
        return "met (the baseline sustains nothing)"
    return "met" if value >= bar else "missed"



def summary_row(figure: str, quantity: str, paper: str, ours: str, ctx: Context, target: str) -> dict:
    """One row of the report's table."""
    return {"figure": figure, "quantity": quantity, "paper": paper, "ours": ours, "clock": ctx.where(), "target": target}


# Figure 12's targets on ShareGPT: (baseline, the paper's range of vLLM's gain over it, our bar).
FIG12_TARGETS = (("Orca (Oracle)", "1.7-2.7x", 1.7), ("Orca (Max)", "2.7-8x", 2.7))


def fig12_target_rows(ctx: Context, rates: dict[str, float]) -> list[dict]:
    """The report's rows for Figure 12's targets, from each system's sustained rate on ShareGPT."""
    rows = []
    for baseline, paper, bar in FIG12_TARGETS:
        gain = ratio_of(rates["vLLM"], rates[baseline])
        quantity = f"ShareGPT: vLLM's sustained rate / {baseline}'s"
        rows.append(summary_row("12", quantity, paper, format_ratio(gain), ctx, target_met(gain, bar)))
    return rows


def latency_panel(title: str, results: dict[str, SearchResult], threshold: float) -> dict:
    """A latency-vs-rate panel for `plots.latency_curves`: every point each search tried."""
    curves = {s: [(p.rate, p.normalized_latency) for p in r.points] for s, r in results.items()}
    return {"title": title, "curves": curves, "threshold": threshold}


def sustained(ctx: Context, dataset: str, system: str = "vLLM") -> float:
    """A system's sustained rate on `dataset` (simulated): from Figure 12 if it ran (now or
    before, at the same profile and trace size), else searched here."""
    key = ("sustained", dataset, system)
    if key in ctx._memo:
        return ctx._memo[key]
    saved = ctx.out_dir / f"fig12_{ctx.profile.name}.json"
    if saved.exists():
        data = json.loads(saved.read_text())["results"]["data"].get(dataset)
        if data and data.get("trace") == ctx.trace_key(dataset):
            ctx._memo[key] = data["systems"][system]["sustained_rate"]
            return ctx._memo[key]
    threshold = 2 * unloaded_latency(ctx, ctx.curve("vLLM", dataset))
    start = ctx.profile.rate_guess[dataset] * START_SHARE[system]
    ctx._memo[key] = sustained_rate(ctx.curve(system, dataset), ctx.cost, threshold, start).sustained_rate
    return ctx._memo[key]


def vllm_sustained(ctx: Context, dataset: str) -> float:
    return sustained(ctx, dataset, "vLLM")
