"""`pagedllm bench ...`: benchmarks that print a table and write JSON, and `pagedllm bench table`,
which renders that JSON as a markdown table for the manual."""

from __future__ import annotations

import argparse
import importlib

# The benchmarks, each a module of this package with a `register(subparsers)` of its own.
BENCHMARKS = (
    "throughput", "sharing", "preemption", "kernel", "matmul", "latency", "dtype", "serve", "paper", "structured",
    "windows", "spec", "gguf_kernels", "llama_cpp", "numerics",
)


def register_benchmark(sub: argparse._SubParsersAction, name: str) -> None:
    importlib.import_module(f"pagedllm.bench.{name}").register(sub)


def register_bench(sub: argparse._SubParsersAction) -> None:
    from pagedllm.bench import table

    parser = sub.add_parser("bench", help="benchmarks (print a table, write JSON)")
    bench_sub = parser.add_subparsers(dest="bench", required=True)
    for name in BENCHMARKS:
        register_benchmark(bench_sub, name)
    table.register(bench_sub)
