"""Matrix products through oneDNN, with each weight reordered once, at load time, into the
blocked layout oneDNN's kernels read (what `torch.compile` does for CPU linears when it freezes
weights).

float32 weights are always packed. bfloat16 and float16 weights are packed where this CPU has
oneDNN's 16-bit instructions (AVX-512 BF16 / AVX-512 FP16, AMX) and a packed product beats
`F.linear` on a trial of decoding's shapes, measured once per process (`packing_pays`): on
other CPUs oneDNN refuses 16-bit reorders, and `F.linear` serves them.

`F.linear` goes to MKL's sgemm, which re-packs the weight on every call and, on AMD CPUs, runs
far from the machine's peak for the skinny products of decoding (`pagedllm bench matmul`
compares the two on the default model's shapes).

The packed tensor is opaque (an MKLDNN tensor); it sits beside the plain weight in the layer's
`FloatLinear` method (`pagedllm.model.quant`), and every other user of the weight (the
embedding, tensor parallel loading, tests) keeps reading the plain one.

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
import logging

import torch
import torch.nn.functional as F

from pagedllm.utils import best_wall_time

logger = logging.getLogger("pagedllm")


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


def _has_16_bit_instructions(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs `dtype` (bfloat16, float16) products natively on this CPU."""
    check = {
        torch.bfloat16: getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None),
        torch.float16: getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None),
    }.get(dtype)
    try:
        return bool(check is not None and check())
    except RuntimeError:
        return False


# The trial of `packing_pays`: a projection of decoding's size at the row counts of small and
# larger decode batches.
_TRIAL_SHAPE = (1536, 1024)
_TRIAL_ROWS = (1, 16, 64)


@functools.cache
def packing_pays(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` are packed: float32 always (`pagedllm bench matmul`); 16-bit
    only where oneDNN has the instructions, its product agrees with F.linear, and it is faster
    on the trial shapes (the best of three timings each, once per process, a few ms)."""
    if dtype == torch.float32:
        return available()
    if not (available() and _has_16_bit_instructions(dtype)):
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(*_TRIAL_SHAPE, generator=gen).to(dtype)
    try:
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            inputs = [torch.randn(rows, _TRIAL_SHAPE[1], generator=gen).to(dtype) for rows in _TRIAL_ROWS]
            for x in inputs:
                expected = F.linear(x.float(), weight.float())
                if not torch.allclose(_bucketed_linear(x, packed, None, None).float(), expected, rtol=2e-2, atol=0.5):
                    logger.info("%s products: F.linear (oneDNN's packed product disagrees on a trial)", dtype)
                    return False
            packed_s = sum(best_wall_time(lambda: _bucketed_linear(x, packed, None, None), 3) for x in inputs)
            plain_s = sum(best_wall_time(lambda: F.linear(x, weight), 3) for x in inputs)
    except RuntimeError as exc:
        logger.info("%s products: F.linear (oneDNN refused a packed weight: %s)", dtype, exc)
        return False
    logger.info("%s products: %s (trial: packed %.2f ms, F.linear %.2f ms)", dtype,
                "oneDNN packed weights" if packed_s < plain_s else "F.linear", packed_s * 1e3, plain_s * 1e3)
    return packed_s < plain_s


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN layout of a CPU weight [out, in], or None where it does not apply (a dtype
    whose packing does not pay here: `packing_pays`)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not packing_pays(weight.dtype):
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
    """x W^T + b with W in its packed layout; x: [..., in] in the weight's dtype. With
    `fixed_rows`, every product runs at exactly that many rows (the last chunk padded)."""
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


def pack_all(weights: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """`pack` of each weight (None where it does not apply). oneDNN's reorder runs on one core
    and releases the GIL, so the weights are packed on as many threads as torch computes with
    (half the time on two cores, a second or more of start-up)."""
    with concurrent.futures.ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="pagedllm-pack") as pool:
        return list(pool.map(pack, weights))
