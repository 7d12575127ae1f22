"""The autotuning sweep of the Triton paged attention kernel: times candidate launch shapes
(tile_n, num_warps, num_stages, num_partitions) per bucket of (kind, head size, GQA group,
context, batch), replayed from CUDA graphs as the engine's decode steps run, and writes the
fastest shape of each bucket into the table the backend reads (pagedllm/attention/triton_tuning.py).

A candidate counts only if its output equals the built-in launch's (the kernel tests check that
one against the reference backend). The search runs in two rounds per bucket, to keep the number
of compilations small: the flash-decoding split first (at the default tile and warps), then the
tile, warps and stages at the best split.

    python benchmarks/gpu_autotune.py --output results/gpu_check/triton_tuning.json
    # then: cp results/gpu_check/triton_tuning.json pagedllm/kernels/tuning/<device>.json
    # (the file name: pagedllm.attention.triton_tuning.device_file(torch.cuda.get_device_name()))

--device cpu --quick runs the sweep's own machinery on the interpreter (tiny shapes, the wall
clock instead of graphs): what the tests run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedllm.attention import AttentionMetadata  # noqa: E402
from pagedllm.attention.triton_backend import (  # noqa: E402
    MAX_PARTITIONS,
    TritonAttentionBackend,
    _tile_n,
)
from pagedllm.attention.triton_tuning import LaunchConfig, TuningEntry, TuningTable  # noqa: E402
from pagedllm.bench.hardware import best_time, graph_time  # noqa: E402
from pagedllm.bench.report import format_table, machine_line  # noqa: E402
from pagedllm.utils import cdiv  # noqa: E402

# (query heads, KV heads, head size): the default model's attention and Llama-3.2-1B's.
SHAPES = {"smollm2": (9, 3, 64), "llama-1b": (32, 8, 64), "tiny": (6, 2, 32)}
TILES, WARPS, STAGES = (16, 32, 64, 128), (2, 4, 8), (1, 2, 3, 4)
# The fewest keys of one partition worth trying.
MIN_PARTITION_KEYS = 64


def step_inputs(kind: str, shape: tuple[int, int, int], context: int, batch: int, block_size: int,
                dtype: torch.dtype, device: torch.device):
    """A step's query, pools and metadata: `batch` decodes over `context` keys each, or one
    prompt of `batch` tokens ending at `context` ("prompt")."""
    heads, kv_heads, head_dim = shape
    gen = torch.Generator().manual_seed(0)
    if kind == "decode":
        query_lens, seq_lens = [1] * batch, [context] * batch
    else:
        query_lens, seq_lens = [batch], [max(context, batch)]
    blocks = [cdiv(n, block_size) for n in seq_lens]
    order = torch.randperm(sum(blocks), generator=gen).to(torch.int32)
    tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[start:start + n]
        start += n
    tokens = sum(query_lens)
    starts = torch.tensor([0] + list(itertools.accumulate(query_lens)))
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(tokens, dtype=torch.int64, device=device), query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, device=device), block_tables=tables.to(device), query_lens=query_lens,
        seq_lens_list=seq_lens, block_size=block_size, num_decodes=sum(q == 1 for q in query_lens),
    )
    query = torch.randn(tokens, heads, head_dim, generator=gen).to(device, dtype)
    pool = (sum(blocks), kv_heads, block_size, head_dim)
    key_cache = torch.randn(pool, generator=gen).to(device, dtype)
    value_cache = torch.randn(pool, generator=gen).to(device, dtype)
    return query, key_cache, value_cache, metadata


def run_launch(launch: LaunchConfig | None, inputs, device: torch.device, repeats: int):
    """(output, seconds per call) of one launch shape; None: the backend's built-in choice."""
    query, key_cache, value_cache, metadata = inputs
    backend = TritonAttentionBackend(device, launch=launch, tuning=TuningTable([]))
    scale = query.shape[-1] ** -0.5

    def call():
        return backend.forward(query, None, None, key_cache, value_cache, metadata, scale)

    metadata.backend_plan = None
    out = call()
    if device.type == "cuda":
        seconds = graph_time(call, repeats) or best_time(call, repeats, device)
    else:
        seconds = best_time(call, repeats, device)
    return out, seconds


def partitions_to_try(kind: str, context: int, tiny: bool) -> list[int]:
    if kind != "decode":
        return [1]
    counts = [p for p in (1, 2, 4, 8, 16, 32) if p <= MAX_PARTITIONS and context // p >= MIN_PARTITION_KEYS]
    return counts[:2] if tiny else counts


def candidates(device: torch.device, quick: bool) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(tiles, warps, stages) to try: a few on the interpreter, every tile and warp count at two
    stages for --quick on a GPU, everything otherwise."""
    if device.type == "cpu":
        return (16, 32), (4,), (2,)
    return (TILES, WARPS, (2,)) if quick else (TILES, WARPS, STAGES)


def sweep_bucket(kind, shape_name, context, batch, args, dtype, device) -> list[dict]:
    shape = SHAPES[shape_name]
    heads, kv_heads, head_dim = shape
    inputs = step_inputs(kind, shape, context, batch, args.block_size, dtype, device)
    expected, default_s = run_launch(None, inputs, device, args.repeats)
    tolerance = dict(atol=1e-5, rtol=0) if dtype == torch.float32 else dict(atol=2e-3, rtol=2**-7)
    base = dict(kind=kind, shape=shape_name, head_dim=head_dim, group=heads // kv_heads, context=context, batch=batch,
                default_us=default_s * 1e6)
    records: list[dict] = []

    def trial(launch: LaunchConfig) -> dict:
        record = dict(base, config=dict(tile_n=launch.tile_n, num_warps=launch.num_warps,
                                        num_stages=launch.num_stages, num_partitions=launch.num_partitions))
        try:
            out, seconds = run_launch(launch, inputs, device, args.repeats)
            torch.testing.assert_close(out.float(), expected.float(), **tolerance)
            record.update(ok=True, us=seconds * 1e6)
        except Exception as e:  # a shape this GPU cannot launch, or one that computes wrong
            record.update(ok=False, us=float("inf"), error=f"{type(e).__name__}: {str(e)[:200]}")
        records.append(record)
        return record

    default_tile = _tile_n(head_dim)
    tiles, warps, stages = candidates(device, args.quick)
    best_split = min(
        (trial(LaunchConfig(default_tile, 4, 2, p)) for p in partitions_to_try(kind, context, device.type == "cpu")),
        key=lambda r: r["us"],
    )["config"]["num_partitions"]
    for tile, warp, stage in itertools.product(tiles, warps, stages):
        if (tile, warp, stage) != (default_tile, 4, 2):
            trial(LaunchConfig(tile, warp, stage, best_split))
    return records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None)
    parser.add_argument("--contexts", type=int, nargs="+", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="decode sequences per step")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=None, help="query tokens of prompt steps")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="default: bfloat16 on a GPU, float32 on the interpreter")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="few shapes, buckets and candidates")
    parser.add_argument("--output", required=True, help="the tuning table (JSON) to write")
    parser.add_argument("--records", default=None, help="also write every candidate's timing here (JSON)")
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU; --device cpu --quick tries the sweep on the interpreter")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    cpu = device.type == "cpu"
    shapes = args.shapes or (["tiny"] if cpu else ["smollm2", "llama-1b"])
    contexts = args.contexts or ([128] if cpu else [256, 1024, 4096] if args.quick else [256, 512, 1024, 2048, 4096])
    batches = args.batches or ([2] if cpu else [1, 64, 256] if args.quick else [1, 8, 32, 64, 128, 256])
    prompt_tokens = args.prompt_tokens or ([32] if cpu else [512] if args.quick else [128, 512, 2048])

    started = time.perf_counter()
    records: list[dict] = []
    buckets = [("decode", s, c, b) for s in shapes for c in contexts for b in batches]
    buckets += [("prompt", s, max(c, t), t) for s in shapes for c in contexts[:1] for t in prompt_tokens]
    for kind, shape_name, context, batch in buckets:
        records += sweep_bucket(kind, shape_name, context, batch, args, dtype, device)

    entries, rows = [], []
    for key, group in itertools.groupby(records, key=lambda r: (r["kind"], r["shape"], r["context"], r["batch"])):
        group = list(group)
        ok = [r for r in group if r["ok"]]
        if not ok:
            continue
        best = min(ok, key=lambda r: r["us"])
        entries.append(TuningEntry(best["kind"], best["head_dim"], best["group"], best["context"], best["batch"],
                                   LaunchConfig(**best["config"])))
        c = best["config"]
        rows.append({"kind": key[0], "shape": key[1], "context": key[2], "batch": key[3],
                     "candidates": len(group), "failed": len(group) - len(ok), "default_us": best["default_us"],
                     "best_us": best["us"], "speedup": best["default_us"] / best["us"],
                     "tile_n/warps/stages/partitions": f"{c['tile_n']}/{c['num_warps']}/{c['num_stages']}/{c['num_partitions']}"})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "interpreter"
    table = TuningTable(entries, device=name)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    import triton

    payload = table.to_json(triton.__version__)
    for raw, row in zip(payload["entries"], rows):  # what it measured, for the reader
        raw["us"], raw["default_us"] = row["best_us"], row["default_us"]
    Path(args.output).write_text(json.dumps(payload, indent=1))
    if args.records:
        Path(args.records).write_text(json.dumps(records, indent=1))
    print(format_table(rows))
    print(f"device: {name}; dtype {dtype}; {len(records)} candidates in {time.perf_counter() - started:.0f} s; "
          f"table: {args.output}")
    print(machine_line())
    return 0 if entries else 1


if __name__ == "__main__":
    sys.exit(main())
