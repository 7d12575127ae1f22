"""Matrix products with weights from their GGUF block quantization (Q4_1, Q8_0).

A layer loaded from a GGUF file keeps, beside its float weight, the raw blocks of the file
(`param.quantized`). For a few rows of input (decoding a handful of sequences), reading the
quantized values (1.25 bytes per weight, against 4 for float32) and expanding them in
registers beats streaming the float weight from memory; for more rows, the float matmul's
arithmetic wins. The blocks are unpacked once (`QuantizedMatrix.unpack`, at load time) into the
layout the kernel reads: one byte per value, float32 scales and minimums.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# GGML type -> bytes per block of 32 weights
QUANT_TYPES = {"Q8_0": 34, "Q4_1": 20}
BLOCK = 32
# Up to this many input rows (sequences decoding together), the quantized kernel is used: the
# row count at which the float32 oneDNN product of every projection of a decode step overtook
# it on the default model (2-core AVX2 machine; `pagedllm bench matmul` measures it).
MAX_ROWS = 15


@dataclass
class Unpacked:
    values: torch.Tensor  # uint8 [out_features, in_features]: Q4_1 0..15, Q8_0 int8 bits
    scales: torch.Tensor  # float32 [out_features, in_features / 32]
    mins: torch.Tensor | None  # float32 [out_features, in_features / 32] (Q4_1), else None


@dataclass
class QuantizedMatrix:
    qtype: str  # a key of QUANT_TYPES
    data: torch.Tensor  # uint8 [out_features, in_features / 32 * bytes per block]
    in_features: int
    _unpacked: Unpacked | None = field(default=None, repr=False)

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def is_unpacked(self) -> bool:
        return self._unpacked is not None

    def unpack(self) -> Unpacked:
        """The kernel's layout of these blocks, built on first call."""
        if self._unpacked is None:
            rows = self.data.shape[0]
            blocks = self.data.view(rows, -1, QUANT_TYPES[self.qtype])  # [rows, blocks, bytes]
            scales = blocks[..., 0:2].contiguous().view(torch.float16).float().view(rows, -1)
            if self.qtype == "Q4_1":
                mins = blocks[..., 2:4].contiguous().view(torch.float16).float().view(rows, -1)
                packed = blocks[..., 4:20]  # value j in the low nibble of byte j, value j + 16 in the high
                values = torch.cat([packed & 0x0F, packed >> 4], dim=-1)
            else:
                mins, values = None, blocks[..., 2:34]
            self._unpacked = Unpacked(values.reshape(rows, self.in_features).contiguous(), scales.contiguous(), mins)
        return self._unpacked


def quantized_matmul(x: torch.Tensor, w: QuantizedMatrix) -> torch.Tensor:
    """x: [rows, in_features] float32 -> x W^T: [rows, out_features] float32."""
    from pagedllm.kernels.build import load

    x = x.contiguous()
    u = w.unpack()
    y = torch.empty(x.shape[0], w.out_features, dtype=torch.float32)
    load().quant_matmul_f32(
        y.data_ptr(), x.data_ptr(), u.values.data_ptr(), u.scales.data_ptr(),
        u.mins.data_ptr() if u.mins is not None else None, x.shape[0], w.out_features, w.in_features,
        torch.get_num_threads(),
    )
    return y


def usable(w: QuantizedMatrix | None, x: torch.Tensor) -> bool:
    return w is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[0] <= MAX_ROWS
