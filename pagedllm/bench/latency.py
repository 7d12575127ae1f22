"""`pagedllm bench latency`: time to first token and time per output token of a batch of
requests of fixed lengths (one request by default), and the decode rate against the roofline
(tokens/s x 2 x parameters / measured matrix-product FLOP/s)."""

from __future__ import annotations

import argparse
import random
import time

import torch

from pagedllm.bench.hardware import matmul_flops, roofline_fraction
from pagedllm.bench.report import format_table, write_json
from pagedllm.entrypoints.cli_args import add_engine_args, engine_args_from


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("latency", help="time to first token and per output token")
    add_engine_args(p)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--output-json", default="results/bench_latency.json")
    p.set_defaults(func=run)


def run_once(engine, batch: int, input_len: int, output_len: int, seed: int) -> tuple[float, list[float]]:
    """(time to first token, [duration of each decode step]) for one batch."""
    from pagedllm.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = engine.arch.vocab_size
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i in range(batch):
        engine.add_request(f"{seed}-{i}", [rng.randint(100, vocab - 1) for _ in range(input_len)], params)
    first_token = None
    steps = []
    last = start
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        if first_token is None:
            if outputs and all(o.outputs[0].token_ids for o in outputs) and len(outputs) == batch:
                first_token = now - start
        else:
            steps.append(now - last)
        last = now
    return first_token, steps


def run(args: argparse.Namespace) -> int:
    from pagedllm.engine.llm_engine import LLMEngine

    engine_args = engine_args_from(args)
    engine_args.max_num_batched_tokens = max(engine_args.max_num_batched_tokens or 0, args.batch_size * args.input_len, 2048)
    engine = LLMEngine.from_engine_args(engine_args)
    dtype = engine.executor.worker.dtype if hasattr(engine.executor, "worker") else torch.float32
    flops = matmul_flops(dtype)
    # Distinct prompts per run (seeds >= 0: Random(-1) equals Random(1)), so none hits the prefix cache.
    run_once(engine, args.batch_size, args.input_len, 4, seed=args.num_iters)  # warm-up
    rows = []
    for i in range(args.num_iters):
        before = engine.get_stats().step_time
        ttft, steps = run_once(engine, args.batch_size, args.input_len, args.output_len, seed=i)
        after = engine.get_stats().step_time
        spent = {part: getattr(after, part) - getattr(before, part) for part in ("scheduler", "model", "outputs")}
        tpot = sum(steps) / len(steps)
        decode_rate = args.batch_size / tpot
        rows.append(
            {
                "iter": i,
                "batch": args.batch_size,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "ttft_ms": ttft * 1e3,
                "tpot_ms": tpot * 1e3,
                "decode_tok_per_s": decode_rate,
                "roofline_pct": 100 * roofline_fraction(decode_rate, engine.arch.num_parameters, flops),
                "scheduler_pct": 100 * spent["scheduler"] / sum(spent.values()),
                "outputs_pct": 100 * spent["outputs"] / sum(spent.values()),
            }
        )
    engine.shutdown()
    print(f"matrix products: {flops / 1e9:.0f} GFLOP/s ({dtype}); model: {engine.arch.num_parameters / 1e6:.1f}M parameters")
    print(format_table(rows))
    best = min(rows, key=lambda r: r["tpot_ms"])
    print(f"best: TTFT {best['ttft_ms']:.1f} ms, TPOT {best['tpot_ms']:.2f} ms, {best['decode_tok_per_s']:.1f} tok/s, "
          f"{best['roofline_pct']:.0f}% of the roofline")
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config["matmul_gflops"] = flops / 1e9
    path = write_json(args.output_json, "latency", config, rows)
    print(f"wrote {path}")
    return 0
