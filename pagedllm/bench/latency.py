"""`pagedllm bench latency`: time to first token and time per output token of a batch of
requests of fixed lengths (one request by default), and the decode rate against the roofline
(tokens/s x 2 x parameters / measured matrix-product FLOP/s).

With `--profile`, it also times each part of a decode step in place (`step_profile`): one more
batch is prefilled, then its decode steps run with the timers installed, and the table gives
each part's milliseconds per step beside the physical bound of that step (the projections'
FLOPs at the measured matrix rate or, where that is longer, as for a quantized model at small
batches, the weights' stored bytes read once at the measured copy bandwidth; plus the KV cache's
bytes at that bandwidth).
The matrix rate is the faster of torch's product and, in float32 on a CPU, the engine's
quantized kernel (which outruns torch's there: a bound from torch alone could be beaten),
measured at the start and again beside the profiled steps, the faster reading kept."""

from __future__ import annotations

import argparse
import random
import time

import torch

from pagedllm.bench.hardware import copy_bandwidth, matrix_rate, roofline_fraction
from pagedllm.bench.progress import Progress
from pagedllm.bench.report import format_table, write_json
from pagedllm.entrypoints.cli_args import add_engine_args, engine_args_from


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("latency", help="time to first token and per output token")
    add_engine_args(p)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="also time each part of a decode step, measured in place")
    p.add_argument("--profile-steps", type=int, default=16, help="decode steps timed by --profile")
    p.add_argument("--output-json", default="results/bench_latency.json")
    p.set_defaults(func=run)


def _add_batch(engine, batch: int, input_len: int, output_len: int, seed: int) -> None:
    from pagedllm.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = engine.arch.vocab_size
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{seed}-{i}", [rng.randint(100, vocab - 1) for _ in range(input_len)], params)


def run_once(engine, batch: int, input_len: int, output_len: int, seed: int,
             progress: Progress | None = None) -> tuple[float, list[float]]:
    """(time to first token, [duration of each decode step]) for one batch."""
    start = time.perf_counter()
    _add_batch(engine, batch, input_len, output_len, seed)
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
            if progress is not None:
                progress.update(len(steps), output_len - 1, "decode steps")
        last = now
    return first_token, steps


def run(args: argparse.Namespace) -> int:
    from pagedllm.engine.llm_engine import LLMEngine

    engine_args = engine_args_from(args)
    engine_args.max_num_batched_tokens = max(engine_args.max_num_batched_tokens or 0, args.batch_size * args.input_len, 2048)
    # The batch's prompts run in one step, then it decodes together: no step-time budget (it
    # would spread a large batch's prompts over steps, and its first sequences would finish
    # before the last began).
    engine_args.max_step_seconds = 0
    progress = Progress("bench latency")
    progress.phase("starting the engine")
    engine = LLMEngine.from_engine_args(engine_args)
    worker = getattr(engine.executor, "worker", None)
    dtype = worker.dtype if worker is not None else torch.float32
    progress.phase("measuring the matrix-product rate")
    flops = matrix_rate(dtype, device=worker.device if worker is not None else "cpu")
    # Distinct prompts per run (seeds >= 0: Random(-1) equals Random(1)), so none hits the prefix cache.
    if args.num_iters:  # --num-iters 0 --profile: the profile alone
        progress.phase("warm-up")
        run_once(engine, args.batch_size, args.input_len, 4, seed=args.num_iters)  # warm-up
    rows = []
    for i in range(args.num_iters):
        progress.phase(f"iteration {i + 1}/{args.num_iters}: a batch of {args.batch_size}, {args.input_len} prompt "
                       f"and {args.output_len} output tokens each")
        before = engine.get_stats().step_time
        ttft, steps = run_once(engine, args.batch_size, args.input_len, args.output_len, seed=i, progress=progress)
        after = engine.get_stats().step_time
        spent = {part: getattr(after, part) - getattr(before, part) for part in ("scheduler", "model", "outputs")}
        if not steps:
            raise RuntimeError(f"the batch of {args.batch_size} never decoded together (it does not fit the KV cache at "
                               f"once): raise --kv-cache-memory or lower --batch-size")
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
    if args.profile:
        progress.phase(f"profiling {args.profile_steps} decode steps")
    profile = _profile(engine, args, flops) if args.profile else None
    engine.shutdown()
    print(f"matrix products: {flops / 1e9:.0f} GFLOP/s ({dtype}); model: {engine.arch.num_parameters / 1e6:.1f}M parameters")
    if rows:
        print(format_table(rows))
        best = min(rows, key=lambda r: r["tpot_ms"])
        print(f"best: TTFT {best['ttft_ms']:.1f} ms, TPOT {best['tpot_ms']:.2f} ms, {best['decode_tok_per_s']:.1f} tok/s, "
              f"{best['roofline_pct']:.0f}% of the roofline")
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config["matmul_gflops"] = flops / 1e9
    if profile is not None:
        print(profile["text"])
        config["profile"] = {k: v for k, v in profile.items() if k != "text"}
    path = write_json(args.output_json, "latency", config, rows)
    print(f"wrote {path}")
    return 0


def step_weight_bytes(model, batch_size: int) -> float:
    """The bytes a decode step of `batch_size` sequences reads: the weights as stored (quantized
    blocks count their bytes; a tied table once), read once a step, but an embedding table apart
    from the head (only its looked-up rows are read), and of a mixture's experts only the share
    its tokens can route to, min(E, batch x k) of E."""
    from pagedllm.model.moe import SparseMoE

    stored = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    table, head = getattr(model, "embedding_weight", None), getattr(getattr(model, "lm_head", None), "weight", None)
    if table is not None and head is not None and table.data_ptr() != head.data_ptr():
        stored -= table.numel() * table.element_size()
    for module in model.modules():
        if isinstance(module, SparseMoE):
            experts = module.experts
            idle = 1 - min(experts.num_experts, batch_size * module.top_k) / experts.num_experts
            stored -= idle * sum(p.numel() * p.element_size() for p in (experts.gate_up_proj, experts.down_proj))
    return stored


def _profile(engine, args: argparse.Namespace, flops: float) -> dict:
    """Time each part of the decode steps of one more batch (prefilled first, untimed)."""
    from pagedllm.bench.step_profile import profile_decode_steps, profile_rows

    _add_batch(engine, args.batch_size, args.input_len, args.profile_steps + 2, seed=args.num_iters + 1)
    prefilled: set[str] = set()
    while len(prefilled) < args.batch_size and engine.has_unfinished_requests():
        prefilled.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    engine.step()  # one decode step untimed: first-call costs stay out of the profile
    steps, parts, calls = profile_decode_steps(engine, args.profile_steps)
    while engine.has_unfinished_requests():
        engine.step()
    worker = engine.executor.worker
    bandwidth = copy_bandwidth(device=worker.device)
    # Measured again beside the timed steps (a shared machine's rate drifts); the faster of the two
    # readings makes the tighter bound.
    flops = max(flops, matrix_rate(worker.dtype, device=worker.device))
    context = args.input_len + len(steps) // 2  # the mean context over the timed steps
    kv_bytes = 2 * args.batch_size * context * worker.num_layers * worker.num_kv_heads * worker.head_dim
    kv_bytes *= worker.cache_dtype.itemsize
    weight_bytes = step_weight_bytes(worker.model, args.batch_size)
    flops_s = 2 * engine.arch.num_parameters * args.batch_size / flops  # (a token's: a mixture's k experts)
    weights_s = weight_bytes / bandwidth
    matrix_s = max(flops_s, weights_s)
    bound_s = matrix_s + kv_bytes / bandwidth
    step_s = sum(steps) / len(steps)
    rows = profile_rows(steps, parts, calls)
    lines = [
        f"decode step profile: batch {args.batch_size}, context {context} (mean), {len(steps)} steps, "
        f"dtype {worker.dtype}, KV cache {worker.cache_dtype}",
        format_table(rows, ["part", "ms_per_step", "pct", "calls_per_step", "covers"]),
        f"physical bound: {1e3 * bound_s:.1f} ms = matrix products {1e3 * matrix_s:.1f} ms (the longer of "
        f"{1e3 * flops_s:.1f} ms of FLOPs at {flops / 1e9:.0f} GFLOP/s, the best measured, and {1e3 * weights_s:.1f} ms "
        f"reading {weight_bytes / 1e6:.0f} MB of weights) + KV reads {1e3 * kv_bytes / bandwidth:.1f} ms "
        f"({kv_bytes / 1e6:.0f} MB at {bandwidth / 1e9:.1f} GB/s measured); step / bound = {step_s / bound_s:.2f}",
    ]
    return {
        "text": "\n".join(lines),
        "rows": rows,
        "step_ms": 1e3 * step_s,
        "bound_ms": 1e3 * bound_s,
        "matrix_gflops": flops / 1e9,
        "copy_bandwidth_gbps": bandwidth / 1e9,
        "kv_bytes": kv_bytes,
        "weight_bytes": weight_bytes,
    }
