"""`pagedllm bench ...`: benchmarks that print a table and write JSON."""

from __future__ import annotations

import argparse


def register_bench(sub: argparse._SubParsersAction) -> None:
    from pagedllm.bench import dtype, kernel, latency, matmul, paper, preemption, serve, sharing, structured, throughput, windows

    parser = sub.add_parser("bench", help="benchmarks (print a table, write JSON)")
    bench_sub = parser.add_subparsers(dest="bench", required=True)
    throughput.register(bench_sub)
    sharing.register(bench_sub)
    preemption.register(bench_sub)
    kernel.register(bench_sub)
    matmul.register(bench_sub)
    latency.register(bench_sub)
    dtype.register(bench_sub)
    serve.register(bench_sub)
    paper.register(bench_sub)
    structured.register(bench_sub)
    windows.register(bench_sub)
