"""`pagedllm bench windows`: the KV memory that sliding windows give back.

For a model with sliding-window layers (any folder, or random models of real shapes built here:
a Mistral whose every layer slides, a Qwen2 hybrid of full and sliding layers, a Gemma-3-shaped
one of 5 sliding to 1 global layer where the engine supports that family), one long generation
runs twice on the same engine: with the blocks that left every window given back to the pool
(the engine as it is), and keeping every block (a KV cache manager told that every layer
attends fully; attention itself is unchanged, so both give the same tokens). Reported for each:
the most blocks (and bytes) the sequence held at once, and how many such sequences a fixed KV
budget holds together, by that peak and by the admission bound the scheduler guarantees (every
sequence fits alone at its full length). Then as many long sequences as the budget holds with
windows run at once, to show they do without preemption.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from pagedllm.bench.report import format_table, write_json

RANDOM_MODELS = ("mistral", "qwen2-hybrid", "gemma3")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("windows", help="KV memory given back by sliding windows on a long generation")
    p.add_argument("model", nargs="?", default=None, help="a model folder (default: the random models of --random)")
    p.add_argument("--random", nargs="+", choices=RANDOM_MODELS, default=["mistral", "qwen2-hybrid"],
                   help="random models of these shapes, built here (when no model folder is given)")
    p.add_argument("--window", type=int, default=512, help="sliding window of the random models")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="the step's token budget: a windowed sequence holds its window plus one step's chunk")
    p.add_argument("--kv-budget-mib", type=float, default=16.0, help="the fixed KV budget of the concurrency count")
    p.add_argument("--max-concurrent", type=int, default=64, help="cap on the concurrent run's sequences (0: skip it)")
    p.add_argument("--output-json", default="results/bench_windows.json")
    p.set_defaults(func=run)


def _random_model(kind: str, window: int, max_len: int, folder: Path) -> Path:
    """A random model of `kind`'s shape (4 layers of hidden 256, 8 heads over 2 KV heads; the
    Gemma-3 one 6 layers, its 6th global) with the default model's tokenizer."""
    import torch
    import transformers

    from pagedllm.transformers_utils import get_tokenizer, resolve_model

    common = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                  max_position_embeddings=max_len, sliding_window=window, tie_word_embeddings=False)
    if kind == "mistral":
        config, cls = transformers.MistralConfig(num_hidden_layers=4, **common), transformers.MistralForCausalLM
    elif kind == "qwen2-hybrid":  # layers from max_window_layers on slide: 2 full, 2 sliding
        config = transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, max_window_layers=2, **common)
        cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.Gemma3TextConfig(num_hidden_layers=6, head_dim=32, **common)
        cls = transformers.Gemma3ForCausalLM
    torch.manual_seed(0)
    path = folder / kind
    cls(config).save_pretrained(str(path))
    get_tokenizer(resolve_model(None)).save_pretrained(str(path))
    return path


def _engine(model: str, args, num_blocks: int | None = None, max_num_seqs: int = 8):
    from pagedllm.config import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs(
        model=model, dtype="float32", max_model_len=args.prompt_len + args.output_len, block_size=args.block_size,
        num_gpu_blocks=num_blocks, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=max_num_seqs,
        enable_prefix_caching=False, disable_log_stats=True,
    ))


def keep_every_block(engine) -> None:
    """Give the engine a KV cache manager that treats every layer as full attention: it keeps
    every block (the baseline). Attention is unchanged. Nothing may be running."""
    from pagedllm.core import create_scheduler

    if engine.has_unfinished_requests():
        raise RuntimeError("switch the KV cache manager only between runs")
    old = engine.scheduler
    bm = old.block_manager
    scheduler = create_scheduler(
        old.config, bm.block_size, bm.num_total_blocks, bm.num_cpu_blocks, engine.max_model_len,
        enable_prefix_caching=False, group_windows=(None,) * bm.num_groups, share_blocks=old.share_blocks,
    )
    engine.core.scheduler = scheduler


def _long_generation(engine, prompt: list[int], output_len: int) -> dict:
    """One sequence generating `output_len` tokens: the most blocks it held at once (counted
    when each step's blocks are allocated, before the step gives back what left the window)."""
    from pagedllm.sampling_params import SamplingParams

    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    seq = engine.requests.groups["long"].seqs[0]
    scheduler = engine.scheduler
    peak, schedule = 0, scheduler.schedule

    def schedule_and_count(*args):
        nonlocal peak
        out = schedule(*args)
        if engine.block_manager.has_blocks(seq.seq_id):
            peak = max(peak, engine.block_manager.num_blocks_held(seq.seq_id))
        return out

    scheduler.schedule, start, tokens = schedule_and_count, time.perf_counter(), []
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens = out.outputs[0].token_ids
    finally:
        del scheduler.schedule  # the class's again
    return {"peak_blocks": peak, "seconds": time.perf_counter() - start, "tokens": tokens}


def _concurrent(model: str, args, num_blocks: int, num_seqs: int, vocab: int) -> dict:
    """`num_seqs` long generations at once in `num_blocks` blocks: preemptions, peak running."""
    from pagedllm.sampling_params import SamplingParams

    engine = _engine(model, args, num_blocks, max_num_seqs=num_seqs)
    rng = random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(str(i), [rng.randrange(100, vocab) for _ in range(args.prompt_len)], params)
    peak_running, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        peak_running = max(peak_running, engine.get_stats().num_running_seqs)
    stats = engine.get_stats()
    engine.shutdown()
    return {"peak_running": peak_running, "preemptions": stats.num_preemptions, "seconds": time.perf_counter() - start}


def measure(model: str, label: str, args) -> dict:
    """The table row of one model."""
    from pagedllm.transformers_utils import load_arch_config, resolve_model

    # Room for the sequence keeping every block in every group (at most one group per layer).
    layers = load_arch_config(resolve_model(model)).num_layers
    engine = _engine(model, args, num_blocks=layers * -(-(args.prompt_len + args.output_len) // args.block_size))
    core = engine.core
    windows = core.executor.group_windows
    rng = random.Random(0)
    prompt = [rng.randrange(100, engine.arch.vocab_size) for _ in range(args.prompt_len)]
    block_bytes = core.executor.block_bytes
    freed = _long_generation(engine, prompt, args.output_len)
    full_len = args.prompt_len + args.output_len
    bound_freed = engine.block_manager.max_blocks_held(args.prompt_len, 1, full_len, True, args.max_num_batched_tokens)
    keep_every_block(engine)
    kept = _long_generation(engine, prompt, args.output_len)
    bound_kept = engine.block_manager.max_blocks_held(args.prompt_len, 1, full_len, True, args.max_num_batched_tokens)
    engine.shutdown()
    budget_blocks = int(args.kv_budget_mib * 2**20) // block_bytes
    row = {
        "model": label,
        "groups": " ".join("full" if w is None else f"w{w}" for w in windows),
        "block_kib": block_bytes / 1024,
        "peak_blocks_freed": freed["peak_blocks"],
        "peak_blocks_kept": kept["peak_blocks"],
        "peak_mib_freed": freed["peak_blocks"] * block_bytes / 2**20,
        "peak_mib_kept": kept["peak_blocks"] * block_bytes / 2**20,
        "saved_pct": 100 * (1 - freed["peak_blocks"] / kept["peak_blocks"]),
        "budget_blocks": budget_blocks,
        "fit_at_peak_freed": budget_blocks // freed["peak_blocks"],
        "fit_at_peak_kept": budget_blocks // kept["peak_blocks"],
        "admission_bound_freed": bound_freed,
        "admission_bound_kept": bound_kept,
        "same_tokens": freed["tokens"] == kept["tokens"],
        "seconds_freed": freed["seconds"],
        "seconds_kept": kept["seconds"],
    }
    num_seqs = min(args.max_concurrent, row["fit_at_peak_freed"])
    if num_seqs > 0:
        run = _concurrent(model, args, budget_blocks, num_seqs, engine.arch.vocab_size)
        row.update(concurrent_seqs=num_seqs, concurrent_peak_running=run["peak_running"],
                   concurrent_preemptions=run["preemptions"], concurrent_seconds=run["seconds"])
    print(f"{label}: {row['peak_blocks_freed']} blocks at peak with windows freed, {row['peak_blocks_kept']} kept "
          f"({row['saved_pct']:.0f}% saved)", flush=True)
    return row


def run(args: argparse.Namespace) -> int:
    rows = []
    with tempfile.TemporaryDirectory(prefix="pagedllm-windows-") as folder:
        if args.model is not None:
            models = [(args.model, Path(args.model).name)]
        else:
            max_len = args.prompt_len + args.output_len
            models = [(str(_random_model(kind, args.window, max_len, Path(folder))), kind) for kind in args.random]
        for model, label in models:
            try:
                rows.append(measure(model, label, args))
            except ValueError as exc:  # a family this engine does not load (yet)
                print(f"{label}: skipped: {exc}", flush=True)
    columns = ["model", "groups", "peak_blocks_freed", "peak_blocks_kept", "peak_mib_freed", "peak_mib_kept", "saved_pct",
               "budget_blocks", "fit_at_peak_freed", "fit_at_peak_kept", "admission_bound_freed", "admission_bound_kept",
               "same_tokens", "concurrent_seqs", "concurrent_peak_running", "concurrent_preemptions"]
    print(format_table(rows, columns))
    config = {k: v for k, v in vars(args).items() if k != "func"}
    path = write_json(args.output_json, "windows", config, rows)
    print(f"wrote {path}")
    return 0
