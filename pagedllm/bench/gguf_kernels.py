"""`pagedllm bench gguf-kernels`: the native GGUF kernels (kernels/gguf.py) per block type, on a
1B-Llama-shaped set of projections (by default q/o 2048x2048, k/v 512x2048, gate/up 8192x2048,
down 2048x8192; random blocks) or an LM head (`--shapes head-262k`, `head-152k`), at decode and
prompt row counts.

Per type and row count: the time of the whole set, as GB/s of weight bytes read and GFLOP/s, on
float32 activations and on int8 ones (`int8=True`), against a float32 torch product of the same
shapes (F.linear and, where it builds, the packed oneDNN product the engine's float32 layers use).
The machine's memory read bandwidth (a buffer well past the caches read as the products read a
weight, `gguf.read_bandwidth`) and its int8 peak (a loop of its widest int8 instruction,
`gguf.int8_peak`) are measured in the same run, so the 1-row products show their share of the
physical bound (weight bytes / bandwidth over the time) and the int8 products their multiply-adds
per second and share of the peak.

`--clock cpu` (with `--threads 1`) times each call by the thread's CPU time instead of the wall
clock: on a machine shared with other work, the time the thread was descheduled is left out.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pagedllm.bench.hardware import best_time
from pagedllm.bench.report import format_table, machine_line, write_json

# The instruction of each path's int8 peak loop (kernels/gguf.py int8_peak).
PEAK_INSTRUCTION = {"avx2": "VPMADDUBSW", "avx512": "VPDPBUSD", "amx": "VPDPBUSD"}
# (out_features, in_features) of one Llama-3.2-1B layer's projections
LLAMA_1B_SHAPES = ((2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192))
# The weight sets `--shapes` names: a 1B layer's projections, and the LM heads (token tables read
# whole at every decode step) of the vocabularies users serve: Gemma 3 270M's 262,144 x 640 and
# Qwen's 151,936 x 1024.
SHAPE_SETS = {
    "1b-layer": LLAMA_1B_SHAPES,
    "head-262k": ((262144, 640),),
    "head-152k": ((151936, 1024),),
}


def register(sub: argparse._SubParsersAction) -> None:
    from pagedllm.kernels.gguf import GGUF_TYPES

    p = sub.add_parser("gguf-kernels", help="native GGUF kernels per type: GB/s and GFLOP/s vs float32 torch")
    p.add_argument("--types", nargs="+", default=list(GGUF_TYPES), choices=list(GGUF_TYPES))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    p.add_argument("--shapes", choices=list(SHAPE_SETS), default="1b-layer",
                   help="the weights: a Llama-3.2-1B layer's 7 projections, or an LM head of 262k or 152k tokens")
    p.add_argument("--isa", default=None, help="force an ISA path (portable, avx2, avx512, amx); default: the best")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch and kernel threads (default: torch's)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: the thread's CPU time (needs --threads 1), robust to a loaded machine")
    p.add_argument("--bandwidth-mb", type=int, default=1024, help="buffer read to measure memory bandwidth")
    p.add_argument("--output-json", default="results/bench_gguf_kernels.json")
    p.set_defaults(func=run)


def cpu_time(fn, repeats: int) -> float:
    """The fastest of `repeats` calls by this thread's CPU time, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best


def _float_baselines(shapes, gen) -> dict:
    from pagedllm.kernels import onednn

    weights = [torch.randn(o, i, generator=gen) * 0.02 for o, i in shapes]
    fns = {"torch": lambda xs: [F.linear(xs[w.shape[1]], w) for w in weights]}
    packed = [onednn.pack(w) for w in weights]
    if all(p is not None for p in packed):
        fns["onednn"] = lambda xs: [onednn.packed_linear(xs[w.shape[1]], p) for w, p in zip(weights, packed)]
    return fns


def run(args: argparse.Namespace) -> int:
    from pagedllm.kernels import gguf
    from pagedllm.model.quant.read_trial import set_read_way_for_machine

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        raise SystemExit("--clock cpu times one thread: pass --threads 1")
    timer = cpu_time if args.clock == "cpu" else best_time
    if args.isa:
        gguf.set_isa(args.isa)
    set_read_way_for_machine()  # (the row streams and prefetch hint the engine reads weights with here)
    shapes = SHAPE_SETS[args.shapes]
    num_weights = sum(o * i for o, i in shapes)
    bandwidth = gguf.read_bandwidth(args.bandwidth_mb)
    peak = max(gguf.int8_peak() for _ in range(3))  # the best of three: a busy core only lowers it
    print(machine_line())  # the CPU and its flags, before the figures they explain
    print(f"{args.shapes}: {len(shapes)} weights of {', '.join(f'{o}x{i}' for o, i in shapes)}, {num_weights / 1e6:.1f}M weights; "
          f"ISA path {gguf.isa()}; memory read bandwidth {bandwidth / 1e9:.1f} GB/s "
          f"({gguf.row_streams()} row streams, prefetch {gguf.prefetch().upper()}); "
          f"int8 peak {peak / 1e9:.1f} G multiply-adds/s ({PEAK_INSTRUCTION.get(gguf.isa(), 'none')}); "
          f"{torch.get_num_threads()} threads; {args.clock} clock")
    gen = torch.Generator().manual_seed(0)
    baselines = _float_baselines(shapes, gen)
    rows_out = []
    with torch.inference_mode():
        inputs = {n: {i: torch.randn(n, i, generator=gen) for i in {i for _, i in shapes}} for n in sorted(set(args.rows))}
        base = {n: {name: timer(lambda: fn(xs), args.repeats) for name, fn in baselines.items()} for n, xs in inputs.items()}
        del baselines
        for qtype in args.types:
            block = gguf.GGUF_TYPES[qtype][0]
            if any(i % block for _, i in shapes):  # (llama.cpp stores such a table in a type of 32-weight blocks)
                print(f"{qtype}: skipped: rows of {', '.join(str(i) for _, i in shapes)} weights are not whole blocks of {block}")
                continue
            packed = [gguf.random_weight(qtype, o, i, gen) for o, i in shapes]
            weight_bytes = sum(w.nbytes for w in packed)
            fns = {
                "gguf": lambda xs: [gguf.matmul(xs[w.in_features], w) for w in packed],
                "gguf_int8": lambda xs: [gguf.matmul(xs[w.in_features], w, int8=True) for w in packed],
            }
            # a fresh weight's first products run slower for a while (measured: 2-3x for tens
            # of calls on the shared test machine), so each type warms up before it is timed
            for _ in range(20):
                fns["gguf"](inputs[min(inputs)])
                fns["gguf_int8"](inputs[min(inputs)])
            for n in inputs:
                xs = inputs[n]
                row = {"type": qtype, "rows": n, "MB": weight_bytes / 1e6}
                times = {name: timer(lambda: fn(xs), args.repeats) for name, fn in fns.items()} | base[n]
                for name, t in times.items():
                    row[f"{name}_ms"] = t * 1e3
                    row[f"{name}_GFLOPs"] = 2 * n * num_weights / t / 1e9
                for name in ("gguf", "gguf_int8"):
                    row[f"{name}_GBps"] = weight_bytes / (row[f"{name}_ms"] / 1e3) / 1e9
                # the physical bound of reading the weights once, over the time taken
                row["gguf_bound_pct"] = 100 * (weight_bytes / bandwidth) / (row["gguf_ms"] / 1e3)
                row["int8_bound_pct"] = 100 * (weight_bytes / bandwidth) / (row["gguf_int8_ms"] / 1e3)
                # the int8 products' multiply-adds per second, and their share of the peak loop's
                row["int8_GMACs"] = n * num_weights / (row["gguf_int8_ms"] / 1e3) / 1e9
                if peak:
                    row["int8_peak_pct"] = 100 * row["int8_GMACs"] * 1e9 / peak
                rows_out.append(row)
                print(f"{qtype} rows {n:4d}: " + ", ".join(f"{k[:-3]} {v:.2f} ms" for k, v in row.items() if k.endswith("_ms")),
                      flush=True)
    columns = ["type", "rows", "MB", "gguf_ms", "gguf_int8_ms", "torch_ms", "onednn_ms",
               "gguf_GBps", "gguf_int8_GBps", "gguf_bound_pct", "int8_bound_pct", "int8_GMACs", "int8_peak_pct",
               "gguf_GFLOPs", "onednn_GFLOPs"]
    columns = [c for c in columns if any(c in r for r in rows_out)]
    print(format_table(rows_out, columns))
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config.update(isa=gguf.isa(), read_bandwidth_GBps=bandwidth / 1e9, int8_peak_GMACs=peak / 1e9,
                  peak_instruction=PEAK_INSTRUCTION.get(gguf.isa()), shapes=[list(s) for s in shapes],
                  num_weights=num_weights)
    path = write_json(args.output_json, "gguf-kernels", config, rows_out)
    print(f"wrote {path}")
    return 0
