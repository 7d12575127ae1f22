"""How the cpu-1b profile's KV budget decides whether memory or the CPU limits the batch: for each
budget, the ShareGPT rates that vLLM, Orca (Oracle) and Orca (Max) sustain on the simulated clock,
priced by this machine's saved calibration of the 1B model (`pagedllm bench paper --profile cpu-1b`
writes it), and vLLM's rate as a share of what it sustains with memory unbounded. Figure 12's
targets (vLLM >= 1.7x Oracle, >= 2.7x Max) are shown beside each budget; the budget is chosen by
the share, as the cpu profile's was (docs/paper.md), not by the targets.

    python benchmarks/paper_kv_budget.py 1024 2048 4096 65536   # after `pagedllm bench paper --profile cpu-1b`
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedllm.bench.paper.calibrate import calibration_file  # noqa: E402
from pagedllm.bench.paper.context import Context, sustained  # noqa: E402
from pagedllm.bench.paper.costs import LinearCost  # noqa: E402
from pagedllm.bench.paper.profiles import cpu_1b_profile  # noqa: E402
from pagedllm.bench.paper.search import Pool  # noqa: E402
from pagedllm.bench.report import cpu_description  # noqa: E402

SYSTEMS = ("vLLM", "Orca (Oracle)", "Orca (Max)")


def budget_table(cost: LinearCost, budgets: list[int], out_dir: Path, requests: int | None = None) -> list[dict]:
    """For each budget (ascending; the largest stands for unbounded memory), the systems' simulated
    ShareGPT sustained rates, vLLM's share of its rate at the largest budget, and its gains."""
    rows = []
    for slots in sorted(budgets):
        ctx = Context(cpu_1b_profile(cost, slots), "simulated", out_dir / f"kv_budget_{slots}", Pool(1), requests)
        rows.append({"kv_slots": slots, "rates": {s: sustained(ctx, "sharegpt", s) for s in SYSTEMS}})
    unbounded = rows[-1]["rates"]["vLLM"]
    for row in rows:
        r = row["rates"]
        row["share_of_largest"] = r["vLLM"] / unbounded
        row["over_oracle"] = r["vLLM"] / r["Orca (Oracle)"]
        row["over_max"] = r["vLLM"] / r["Orca (Max)"]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("slots", type=int, nargs="+", help="KV budgets in tokens (multiples of 16)")
    parser.add_argument("--results", default="results/paper", help="the folder holding calibration_cpu-1b.json (bench paper's --output-dir)")
    parser.add_argument("--json", default=None, help="where to write the table (default: RESULTS/kv_budget_cpu-1b.json)")
    args = parser.parse_args()
    saved_path = Path(args.results) / calibration_file("cpu-1b")
    if not saved_path.exists():
        print(f"No calibration at {saved_path}: run `pagedllm bench paper --profile cpu-1b --output-dir {args.results}` first.")
        return 1
    saved = json.loads(saved_path.read_text())
    cost = LinearCost(**saved["cost"])
    cpu, flags = cpu_description()
    print(f"CPU: {cpu} ({' '.join(flags)}); calibration {saved_path} ({saved['cpu']}): "
          f"{cost.c_step * 1e3:.1f} ms + {cost.c_decode * 1e3:.2f} ms per decoding sequence + "
          f"{cost.c_prefill * 1e3:.2f} ms per prompt token")
    rows = budget_table(cost, args.slots, Path(args.results))
    print(f"{'KV slots':>9} {'vLLM':>7} {'Oracle':>7} {'Max':>7} {'vLLM/largest':>13} {'/Oracle':>8} {'/Max':>6}")
    for row in rows:
        r = row["rates"]
        print(f"{row['kv_slots']:>9} {r['vLLM']:7.3f} {r['Orca (Oracle)']:7.3f} {r['Orca (Max)']:7.3f} "
              f"{row['share_of_largest']:12.0%} {row['over_oracle']:7.2f}x {row['over_max']:5.2f}x")
    out = Path(args.json or Path(args.results) / "kv_budget_cpu-1b.json")
    out.write_text(json.dumps({"cpu": cpu, "cpu_flags": flags, "calibration": saved["cost"], "rows": rows}, indent=1))
    print(f"(the largest budget stands for unbounded memory; sustained rates in req/s) wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
