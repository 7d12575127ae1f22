"""Matrix products with weights kept in their GGUF block quantization (Q4_1, Q8_0).

A layer loaded from a GGUF file keeps, beside its float weight, the raw blocks of the file
(`param.quantized`). For a few rows of input (decoding a handful of sequences), reading the
blocks (4-8x fewer bytes) and expanding them in registers beats streaming the float weight
from memory; for more rows, the float matmul's arithmetic wins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# GGML type -> (kernel id, bytes per block of 32 weights)
QUANT_TYPES = {"Q8_0": (0, 34), "Q4_1": (1, 20)}
BLOCK = 32
# Up to this many input rows (sequences decoding together), the quantized kernel is used.
# Measured on the default model, 2-core AVX2 machine, decode step: batch 1 3.2x faster,
# batch 16 1.24x, batch 24 1.07x, batch 32 0.91x.
MAX_ROWS = 12


@dataclass
class QuantizedMatrix:
    qtype: str  # a key of QUANT_TYPES
    data: torch.Tensor  # uint8 [out_features, in_features / 32 * bytes per block]
    in_features: int

    @property
    def out_features(self) -> int:
        return self.data.shape[0]


def quantized_matmul(x: torch.Tensor, w: QuantizedMatrix) -> torch.Tensor:
    """x: [rows, in_features] float32 -> x W^T: [rows, out_features] float32."""
    from pagedllm.kernels.build import load

    x = x.contiguous()
    y = torch.empty(x.shape[0], w.out_features, dtype=torch.float32)
    load().quant_matmul_f32(
        y.data_ptr(), x.data_ptr(), w.data.data_ptr(), x.shape[0], w.out_features, w.in_features,
        QUANT_TYPES[w.qtype][0], torch.get_num_threads(),
    )
    return y


def usable(w: QuantizedMatrix | None, x: torch.Tensor) -> bool:
    return w is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[0] <= MAX_ROWS
