"""`pagedllm bench preemption`: swapping vs recomputation under a KV budget that overflows (the
paper's Figure 19).

The same requests run with each preemption mode at each block size, with a KV cache of a fixed
number of tokens that holds only part of the workload at once, so requests are preempted
again and again. Reported: end-to-end time, preemptions, the swap traffic (blocks and bytes),
and the tokens computed again by recomputation. Prefix caching is off unless asked for, so that
recomputation really recomputes.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from pagedllm.bench.datasets import sample_requests
from pagedllm.bench.progress import Progress
from pagedllm.bench.report import format_table, write_json
from pagedllm.entrypoints.cli_args import add_engine_args, engine_args_from
from pagedllm.utils import cdiv


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("preemption", help="swap vs recompute at several block sizes")
    add_engine_args(p)
    p.add_argument("--dataset", choices=("sharegpt", "alpaca"), default="sharegpt")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128])
    p.add_argument("--modes", nargs="+", default=["recompute", "swap", "auto"], choices=("recompute", "swap", "auto"))
    p.add_argument("--kv-tokens", type=int, default=1024, help="KV cache size in tokens (the overflowing budget)")
    p.add_argument("--output-json", default="results/bench_preemption.json")
    p.set_defaults(func=run, max_model_len=512, enable_prefix_caching=False)


def run_one(engine_args, requests) -> dict:
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams

    progress = Progress("bench preemption")
    progress.phase(f"block size {engine_args.block_size}, {engine_args.preemption_mode}: starting the engine")
    engine = LLMEngine.from_engine_args(engine_args)
    progress.phase(f"block size {engine_args.block_size}, {engine_args.preemption_mode}: running {len(requests)} requests")
    start = time.perf_counter()
    for i, req in enumerate(requests):
        engine.add_request(str(i), req.prompt_token_ids, SamplingParams(temperature=0, max_tokens=req.output_len, ignore_eos=True))
    num_finished = 0
    while engine.has_unfinished_requests():
        num_finished += sum(o.finished for o in engine.step())
        progress.update(num_finished, len(requests), "requests done")
    elapsed = time.perf_counter() - start
    stats = engine.get_stats()
    needed = sum(len(r.prompt_token_ids) + r.output_len - 1 for r in requests)  # work without preemption
    block_bytes = engine.executor.block_bytes
    engine.shutdown()
    return {
        "elapsed_s": elapsed,
        "preemptions": stats.num_preemptions,
        "swap_preemptions": stats.num_swap_preemptions,
        "recompute_preemptions": stats.num_recompute_preemptions,
        "blocks_swapped": stats.num_blocks_swapped_out + stats.num_blocks_swapped_in,
        "swap_mib": (stats.num_blocks_swapped_out + stats.num_blocks_swapped_in) * block_bytes / 2**20,
        "recomputed_tokens": stats.num_computed_tokens - needed,
    }


def run(args: argparse.Namespace) -> int:
    base = engine_args_from(args)
    rows = []
    requests = None
    for block_size in args.block_sizes:
        num_blocks = max(args.kv_tokens // block_size, cdiv(base.max_model_len, block_size))
        for mode in args.modes:
            engine_args = replace(base, block_size=block_size, num_gpu_blocks=num_blocks, preemption_mode=mode)
            if requests is None:
                from pagedllm.transformers_utils import load_arch_config, resolve_model

                vocab = load_arch_config(resolve_model(base.model)).vocab_size
                requests = sample_requests(args.dataset, args.num_prompts, base.max_model_len, vocab, seed=0)
            row = {"block_size": block_size, "mode": mode, **run_one(engine_args, requests)}
            rows.append(row)
            print(f"block {block_size:4d} {mode:9s}: {row['elapsed_s']:.1f}s, {row['preemptions']} preemptions", flush=True)
    for row in rows:
        recompute = next(r for r in rows if r["block_size"] == row["block_size"] and r["mode"] == rows[0]["mode"])
        row[f"time_vs_{rows[0]['mode']}"] = row["elapsed_s"] / recompute["elapsed_s"]
    print(format_table(rows))
    path = write_json(args.output_json, "preemption", {k: v for k, v in vars(args).items() if k != "func"}, rows)
    print(f"wrote {path}")
    return 0
