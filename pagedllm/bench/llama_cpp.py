"""`pagedllm bench llama-cpp build|bench`: build the llama.cpp peer once (`llama_cpp_peer`), and
`llama-bench`'s prompt (pp) and generation (tg) tokens/s for GGUF files at given thread counts,
as a table with the machine's CPU and as JSON."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pagedllm.bench.report import format_table, write_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("llama-cpp", help="build the llama.cpp peer; llama-bench on GGUF files")
    actions = p.add_subparsers(dest="llama_cpp_action", required=True)
    build = actions.add_parser("build", help="build llama-server, llama-quantize, llama-bench and llama-perplexity once")
    build.add_argument("--dir", help="where to build (default: $PAGEDLLM_LLAMA_CPP_DIR or ~/.cache/pagedllm/llama.cpp/<version>)")
    build.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    build.set_defaults(func=run_build)
    bench = actions.add_parser("bench", help="llama-bench's pp and tg tokens/s")
    bench.add_argument("models", nargs="+", help="GGUF files")
    bench.add_argument("--threads", type=int, nargs="+", default=[2])
    bench.add_argument("--n-prompt", type=int, default=512)
    bench.add_argument("--n-gen", type=int, default=128)
    bench.add_argument("--repetitions", type=int, default=3)
    bench.add_argument("--dir", help="the llama.cpp build (default as for build)")
    bench.add_argument("--output-json", default="results/bench_llama_cpp.json")
    bench.set_defaults(func=run_bench)


def run_build(args: argparse.Namespace) -> int:
    from pagedllm.bench.llama_cpp_peer import LlamaCppPeerError, ensure_llama_cpp

    start = time.perf_counter()
    try:
        binaries = ensure_llama_cpp(Path(args.dir) if args.dir else None, jobs=args.jobs)
    except LlamaCppPeerError as exc:
        print(exc)
        return 1
    print(f"llama.cpp binaries in {binaries} ({time.perf_counter() - start:.0f} s)")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from pagedllm.bench.llama_cpp_peer import LlamaCppPeerError, ensure_llama_cpp, gguf_file, run_llama_bench

    try:
        binaries = ensure_llama_cpp(Path(args.dir) if args.dir else None)
        rows = []
        for model in args.models:
            path = gguf_file(model)
            for threads in args.threads:
                for row in run_llama_bench(binaries, path, threads, args.n_prompt, args.n_gen, args.repetitions):
                    rows.append({"model": path.name, "file_gib": path.stat().st_size / (1 << 30), **row})
                    print(f"{path.name} {row['test']} at {threads} threads: {row['tok_per_s']:.1f} tok/s", flush=True)
    except LlamaCppPeerError as exc:
        print(exc)
        return 1
    print(format_table(rows, ["model", "file_gib", "model_params", "threads", "test", "tok_per_s", "stddev_tok_per_s"]))
    config = {k: v for k, v in vars(args).items() if k != "func"}
    print(f"wrote {write_json(args.output_json, 'llama_cpp_bench', config, rows)}")
    return 0
