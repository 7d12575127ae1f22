"""float32 matrix products through oneDNN, with each weight reordered once, at load time, into
the blocked layout oneDNN's kernels read (what `torch.compile` does for CPU linears when it
freezes weights).

`F.linear` goes to MKL's sgemm, which re-packs the weight on every call and, on AMD CPUs, runs
far from the machine's peak for the skinny products of decoding (`pagedllm bench matmul`
compares the two on the default model's shapes).

The packed tensor is opaque (an MKLDNN tensor); it sits beside the plain weight as
`weight.packed`, which every other user of the weight (the embedding, tensor parallel loading,
tests) keeps reading.

oneDNN builds (JIT-compiles) and caches one primitive per distinct shape of product, about 0.6 MB
each, up to its cache's 1024 entries. A server sees every row count (each decode batch size,
each prompt length), so the products here run on a bounded set of row counts instead: rows are
padded up to a bucket (exact to 16, then eight buckets per doubling, so at most 12.5% extra
rows) and more than `CHUNK_ROWS` rows go through in chunks of that many. That is 48 primitives
per weight shape, built while the server warms up, and no growth after.
"""

from __future__ import annotations

import concurrent.futures
import functools

import torch
from torch import nn


@functools.cache
def available() -> bool:
    """oneDNN's packed linear is built into this torch and agrees with F.linear on a trial."""
    ops = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or ops is None:
        return False
    try:
        w = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
        x = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
        y = ops._linear_pointwise(x, ops._reorder_linear_weight(w, None), None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return torch.allclose(y, x @ w.t(), atol=1e-4)


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN layout of a float32 CPU weight [out, in], or None where it does not apply."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2 or not available():
        return None
    with torch.inference_mode():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


CHUNK_ROWS = 256


def row_bucket(rows: int) -> int:
    """The row count a product of `rows` rows runs at (`rows` <= CHUNK_ROWS): `rows` itself up
    to 16, then rounded up to a step of 1/8 of the power of two above it."""
    if rows <= 16:
        return rows
    step = 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, fixed_rows: int | None = None
) -> torch.Tensor:
    """x W^T + b with W in its packed layout; x: [..., in] float32. With `fixed_rows`, every
    product runs at exactly that many rows (the last chunk padded)."""
    rows = x.reshape(-1, x.shape[-1])
    chunk_rows = fixed_rows or CHUNK_ROWS
    if rows.shape[0] <= chunk_rows:
        out = _bucketed_linear(rows, packed, bias, fixed_rows)
    else:
        out = torch.cat([_bucketed_linear(chunk, packed, bias, fixed_rows) for chunk in rows.split(chunk_rows)])
    return out.view(*x.shape[:-1], out.shape[-1])


def _bucketed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, fixed_rows: int | None) -> torch.Tensor:
    rows = x.shape[0]
    bucket = fixed_rows or row_bucket(rows)
    if bucket != rows:
        x = torch.nn.functional.pad(x, (0, 0, 0, bucket - rows))
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out[:rows] if bucket != rows else out


def pack_weights(params: list[nn.Parameter]) -> int:
    """Attach `packed` to each parameter that can take it; returns how many did. oneDNN's
    reorder runs on one core and releases the GIL, so the weights are packed on as many threads
    as torch computes with (half the time on two cores, a second or more of start-up)."""
    with concurrent.futures.ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="pagedllm-pack") as pool:
        for param, packed in zip(params, pool.map(pack, params)):
            param.packed = packed
    return sum(param.packed is not None for param in params)
