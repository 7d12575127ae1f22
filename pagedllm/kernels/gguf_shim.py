"""TEMPORARY (issue 34): the kernels branch's `pagedllm.kernels.gguf` API, served by today's
Q4_1/Q8_0 kernels (`quant.py`) and, for the other types, by dequantizing with gguf on every
product (correct, slow). Deleted once `pagedllm/kernels/gguf.py` is merged."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

GGUF_TYPES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
              "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
TYPE_IDS = {"Q4_1": 3, "Q8_0": 8}  # the C ABI serves these two here


@dataclass
class PackedWeight:
    qtype: str
    out_features: int
    in_features: int
    data: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def pack(qtype: str, raw: torch.Tensor, in_features: int) -> PackedWeight:
    rows = raw.shape[0]
    if qtype not in TYPE_IDS:
        return PackedWeight(qtype, rows, in_features, raw.contiguous())
    block_bytes = GGUF_TYPES[qtype][1]
    blocks = raw.reshape(rows, -1, block_bytes)
    scales = blocks[..., 0:2].contiguous().view(torch.float16).float()
    parts = [blocks[..., 4:20] if qtype == "Q4_1" else blocks[..., 2:34], scales.view(torch.uint8)]
    if qtype == "Q4_1":
        parts.append(blocks[..., 2:4].contiguous().view(torch.float16).float().view(torch.uint8))
    return PackedWeight(qtype, rows, in_features, torch.cat([p.reshape(-1) for p in parts]))


def from_data(qtype: str, out_features: int, in_features: int, data: torch.Tensor) -> PackedWeight:
    return PackedWeight(qtype, out_features, in_features, data)


def _lib():
    from pagedllm.kernels.build import load

    lib = load()
    lib.gguf_matmul.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.gguf_matmul.restype = None
    return lib


def _dequantize_raw(w: PackedWeight, rows: torch.Tensor | None) -> torch.Tensor:
    import gguf

    raw = w.data if rows is None else w.data[rows]
    out = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[w.qtype])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


def matmul(x: torch.Tensor, w: PackedWeight, int8: bool = False) -> torch.Tensor:
    x = x.contiguous()
    if w.qtype not in TYPE_IDS:
        return x @ _dequantize_raw(w, None).T
    y = torch.empty(x.shape[0], w.out_features, dtype=torch.float32)
    _lib().gguf_matmul(TYPE_IDS[w.qtype], y.data_ptr(), x.data_ptr(), w.data.data_ptr(), x.shape[0], w.out_features,
                       w.in_features, torch.get_num_threads(), int(int8))
    return y


def dequantize_rows(w: PackedWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    if w.qtype not in TYPE_IDS:
        return _dequantize_raw(w, rows)
    n, k = w.out_features, w.in_features
    value_bytes = n * k // 2 if w.qtype == "Q4_1" else n * k
    values = w.data[:value_bytes].view(n, -1)
    scales = w.data[value_bytes : value_bytes + n * k // 8].view(torch.float32).view(n, -1)
    if rows is not None:
        values, scales = values[rows], scales[rows]
    if w.qtype == "Q8_0":
        q = values.view(torch.int8).float().view(values.shape[0], -1, 32)
        return (q * scales.unsqueeze(-1)).reshape(values.shape[0], k)
    mins = w.data[value_bytes + n * k // 8 :].view(torch.float32).view(n, -1)
    if rows is not None:
        mins = mins[rows]
    b = values.view(values.shape[0], -1, 16)
    q = torch.cat([b & 15, b >> 4], dim=-1).float()
    return (q * scales.unsqueeze(-1) + mins.unsqueeze(-1)).reshape(values.shape[0], k)


def isa() -> str:
    return "shim"
