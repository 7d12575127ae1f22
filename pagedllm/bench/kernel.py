"""`pagedllm bench kernel`: decode attention alone, paged (the CPU kernel on a CPU, the Triton
kernel on a GPU, reading blocks in place) vs the reference backend (gathers blocks per sequence)
vs torch's contiguous `scaled_dot_product_attention` on the same keys and values, over context
lengths and batch sizes. Effective bandwidth = bytes of keys and values read / time, against a
measured large copy on the same device (reads and writes counted). Shapes of the default model's
attention: 9 query heads, 3 KV heads, head size 64, blocks of 16."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from pagedllm.bench.hardware import best_time, copy_bandwidth, graph_time
from pagedllm.bench.report import format_table, write_json
from pagedllm.utils import cdiv


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kernel", help="paged decode attention vs reference vs contiguous SDPA")
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--num-heads", type=int, default=9)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="default: float32 on a CPU, bfloat16 on a GPU")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cpu: the C++ kernel; cuda: the Triton kernel (auto: cuda when there is one)")
    p.add_argument("--max-reference-tokens", type=int, default=65536, help="skip the slow reference above batch x context")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--contiguous-blocks", action="store_true", help="consecutive block ids per sequence (default: scattered)")
    p.add_argument("--output-json", default="results/bench_kernel.json")
    p.set_defaults(func=run)


def paged_backend(device: torch.device):
    if device.type == "cuda":
        from pagedllm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    from pagedllm.attention.cpu import CPUAttentionBackend

    return CPUAttentionBackend()


def measure(batch: int, context: int, args, dtype: torch.dtype, device: torch.device) -> dict:
    from pagedllm.attention import AttentionMetadata
    from pagedllm.attention.reference import ReferenceAttentionBackend

    h, hkv, d, bs = args.num_heads, args.num_kv_heads, args.head_dim, args.block_size
    blocks_per_seq = cdiv(context, bs)
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator().manual_seed(0)
    # Sequences own scattered blocks (a random permutation of the pool), or, with
    # --contiguous-blocks, runs of consecutive ids (as a fresh pool hands them out).
    order = torch.arange(num_blocks) if args.contiguous_blocks else torch.randperm(num_blocks, generator=gen)
    tables = order.view(batch, blocks_per_seq).to(torch.int32).to(device)
    query = torch.randn(batch, h, d, generator=gen).to(dtype).to(device)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(batch + 1, device=device),
        seq_lens=torch.full((batch,), context, device=device),
        block_tables=tables,
        query_lens=[1] * batch,
        seq_lens_list=[context] * batch,
        block_size=bs,
        num_decodes=batch,
    )
    scale = d**-0.5
    row = {"batch": batch, "context": context}
    kv_bytes = 2 * batch * context * hkv * d * query.element_size()

    paged = paged_backend(device)
    # Both fast backends lay a pool out as [blocks, kv heads, block size, head dim].
    kc = torch.randn(paged.kv_cache_shape(num_blocks, bs, hkv, d), device=device).to(dtype)
    vc = torch.randn_like(kc)
    paged_call = lambda: paged.forward(query, None, None, kc, vc, metadata, scale)  # noqa: E731
    t = best_time(paged_call, args.repeats, device)
    row["paged_ms"] = t * 1e3
    row["paged_GBps"] = kv_bytes / t / 1e9

    # Contiguous SDPA on the same logical keys/values: [batch, kv_heads, context, head_dim].
    k = kc[tables.long()].permute(0, 2, 1, 3, 4).reshape(batch, hkv, -1, d)[:, :, :context].contiguous()
    v = vc[tables.long()].permute(0, 2, 1, 3, 4).reshape(batch, hkv, -1, d)[:, :, :context].contiguous()
    q = query.unsqueeze(2)  # [batch, heads, 1, head_dim]
    sdpa_call = lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)  # noqa: E731
    t = best_time(sdpa_call, args.repeats, device)
    row["sdpa_ms"] = t * 1e3
    row["paged_vs_sdpa"] = row["paged_ms"] / row["sdpa_ms"]
    if device.type == "cuda":
        # The same calls replayed from CUDA graphs: the kernels' own time, without the host's
        # launch costs that dominate small shapes above (as the engine's decode steps run).
        paged_s, sdpa_s = graph_time(paged_call, args.repeats), graph_time(sdpa_call, args.repeats)
        if paged_s is not None and sdpa_s is not None:
            row["paged_graph_ms"], row["sdpa_graph_ms"] = paged_s * 1e3, sdpa_s * 1e3
            row["paged_vs_sdpa_graph"] = paged_s / sdpa_s
            row["paged_graph_GBps"] = kv_bytes / paged_s / 1e9

    if batch * context <= args.max_reference_tokens:
        ref = ReferenceAttentionBackend()  # its own layout; the timing does not depend on the values
        rkc = torch.randn(ref.kv_cache_shape(num_blocks, bs, hkv, d), device=device).to(dtype)
        rvc = torch.randn_like(rkc)
        t = best_time(lambda: ref.forward(query, None, None, rkc, rvc, metadata, scale), max(1, args.repeats // 2), device)
        row["reference_ms"] = t * 1e3
    return row


def run(args: argparse.Namespace) -> int:
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device.")
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth(device=device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"memory copy on {where}: {bandwidth / 1e9:.1f} GB/s (reads + writes)")
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            row = measure(batch, context, args, dtype, device)
            row["paged_pct_of_copy"] = 100 * row["paged_GBps"] * 1e9 / bandwidth
            if "paged_graph_GBps" in row:
                row["paged_graph_pct_of_copy"] = 100 * row["paged_graph_GBps"] * 1e9 / bandwidth
            rows.append(row)
            print(f"context {context:5d} batch {batch:4d}: paged {row['paged_ms']:.2f} ms ({row['paged_GBps']:.1f} GB/s), "
                  f"sdpa {row['sdpa_ms']:.2f} ms", flush=True)
    columns = ["context", "batch", "paged_ms", "sdpa_ms", "reference_ms", "paged_vs_sdpa", "paged_GBps", "paged_pct_of_copy"]
    if device.type == "cuda":
        columns += ["paged_graph_ms", "sdpa_graph_ms", "paged_vs_sdpa_graph", "paged_graph_pct_of_copy"]
    print(format_table(rows, columns))
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config["copy_bandwidth_GBps"] = bandwidth / 1e9
    path = write_json(args.output_json, "kernel", config, rows)
    print(f"wrote {path}")
    return 0
