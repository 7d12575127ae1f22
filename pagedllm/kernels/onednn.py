"""float32 matrix products through oneDNN, with each weight reordered once, at load time, into
the blocked layout oneDNN's kernels read (what `torch.compile` does for CPU linears when it
freezes weights).

`F.linear` goes to MKL's sgemm, which re-packs the weight on every call and, on AMD CPUs, runs
far from the machine's peak for the skinny products of decoding (`pagedllm bench matmul`
compares the two on the default model's shapes).

The packed tensor is opaque (an MKLDNN tensor); it sits beside the plain weight as
`weight.packed`, which every other user of the weight (the embedding, tensor parallel loading,
tests) keeps reading.
"""

from __future__ import annotations

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


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b with W in its packed layout; x: [..., in] float32."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_weights(params: list[nn.Parameter]) -> int:
    """Attach `packed` to each parameter that can take it; returns how many did."""
    count = 0
    for param in params:
        param.packed = pack(param)
        count += param.packed is not None
    return count
