"""`pagedllm bench paper`: the paper's evaluation (section 6), reproduced on this engine.

The baselines are memory policies of the engine's own scheduler (`kv_policy`: Orca's three
reservation sizes and FasterTransformer-style static batching, `pagedllm.core.reservation`);
vLLM is the engine as it is. Two clocks:
- `--clock simulated` (default): the real scheduler, KV cache managers and output processing
  step by step, with the model replaced by a per-step cost from a profile (`--profile
  a100-opt13b`, the paper's scale, or `cpu`, calibrated on this machine);
- `--clock real`: the default model really run on short traces (figures 2, 12 and 13), which
  also validates the simulation against it.
Each figure prints which clock produced it and writes `figN_<profile or real>.png` and
`.json` to the output folder; `report.md` there is rewritten from every figure's JSON after
each run. Modules: traces, costs and profiles, the simulator and the real driver, the search
for sustained rates, the figures, their plots and the report.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

DEFAULT_FIGURES = "2,11,12,13,14,15,16,18b,19"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("paper", help="the paper's evaluation: figures, JSON and a report (simulated or real clock)")
    p.add_argument("--figures", default=DEFAULT_FIGURES, help=f"comma-separated figure numbers (default: {DEFAULT_FIGURES})")
    p.add_argument("--clock", choices=("simulated", "real"), default="simulated")
    p.add_argument(
        "--profile", choices=("a100-opt13b", "cpu", "cpu-1b"), default=None,
        help="simulated: a100-opt13b (default), cpu or cpu-1b; real: cpu (default) or cpu-1b"
    )
    p.add_argument("--model", default=None, help="cpu-1b: the 1B-class model (default: the benchmark's 1B Q4_K_M file)")
    p.add_argument("--kv-slots", type=int, default=None, help="cpu-1b: the KV budget in tokens (default 1024: one full-length sequence)")
    p.add_argument("--threads", type=int, default=None, help="cpu-1b: torch threads (default 2)")
    p.add_argument("--output-dir", default="results/paper")
    p.add_argument("--jobs", type=int, default=2, help="simulations run in parallel")
    p.add_argument(
        "--requests", type=int, default=None, help="requests per trace (default: the profile's; small for a quick look)"
    )
    p.add_argument("--recalibrate", action="store_true", help="measure the cpu profile's (or cpu-1b's) step cost again")
    p.add_argument(
        "--real-search",
        action="store_true",
        help="real clock, figure 12: also search the sustained rates of vLLM, the three Orcas and static batching on "
        "ShareGPT with real runs (the paper's ratios as a target; about 45 minutes for cpu, an hour for cpu-1b)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedllm.bench.paper.context import Context
    from pagedllm.bench.paper.figures import FIGURES
    from pagedllm.bench.paper.profiles import get_profile
    from pagedllm.bench.paper.real_figures import REAL_FIGURES
    from pagedllm.bench.paper.report import write_report
    from pagedllm.bench.paper.search import Pool
    from pagedllm.bench.report import format_table, write_json

    wanted = [f.strip() for f in args.figures.split(",") if f.strip()]
    unknown = [f for f in wanted if f not in FIGURES]
    if unknown:
        raise ValueError(f"Unknown figure(s) {unknown}; choose from {', '.join(FIGURES)}.")
    # Figure 12 first: the others read vLLM's sustained rate from it.
    wanted.sort(key=lambda f: (f != "12", list(FIGURES).index(f)))
    profile_name = args.profile or ("cpu" if args.clock == "real" else "a100-opt13b")
    if args.model and profile_name == "cpu" and args.profile is None:
        profile_name = "cpu-1b"  # --model alone means the 1B profile
    if args.clock == "real" and profile_name not in ("cpu", "cpu-1b"):
        raise ValueError("The real clock runs on this CPU: use --profile cpu (the default model) or cpu-1b (--model).")
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    profile = get_profile(profile_name, out_dir, args.recalibrate, args.model, args.kv_slots, args.threads)
    ctx = Context(profile, args.clock, out_dir, Pool(args.jobs), args.requests, real_search=args.real_search)
    config = {"clock": args.clock, "profile": profile.name, "scale": profile.scale.__dict__, "cost": profile.cost.describe(),
              "length_scale": profile.length_scale, "requests": args.requests, "jobs": args.jobs}
    total = time.perf_counter()
    for figure in wanted:
        if args.clock == "real" and figure not in REAL_FIGURES:
            print(f"\nFigure {figure}: no real-clock version (it would take hours on this CPU); use --clock simulated.")
            continue
        print(f"\nFigure {figure}: {ctx.where()} ...", flush=True)
        start = time.perf_counter()
        result = (REAL_FIGURES if args.clock == "real" else FIGURES)[figure](ctx)
        seconds = time.perf_counter() - start
        result.update(
            {"figure": figure, "clock": args.clock, "profile": profile.name, "where": ctx.where(), "seconds": seconds}
        )
        print(format_table(result["summary"], ["quantity", "paper", "ours", "target"]))
        path = write_json(out_dir / f"fig{figure}_{ctx.tag}.json", f"paper fig {figure}", config, result)
        print(f"Figure {figure} ({ctx.where()}) took {seconds:.0f} s; wrote {ctx.path(f'fig{figure}')} and {path}")
    report = write_report(out_dir)
    print(f"\nAll done in {time.perf_counter() - total:.0f} s; wrote {report}")
    return 0
