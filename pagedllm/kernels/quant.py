"""Matrix products with weights from their GGUF block quantization (Q4_1, Q8_0).

A layer loaded from a GGUF file keeps, beside its float weight, the raw blocks of the file
(`param.quantized`). Every float32 product on a CPU multiplies from them (csrc/quant_matmul.cpp):
with a few rows of input (sequences decoding together) reading the quantized values (0.75 bytes
per Q4_1 weight, against 4 for float32) and expanding them on the fly beats the float product,
and with many (prompts) its tiled way runs at about the float products' rate or above (oneDNN's
packed product falls to about 70-85 GFLOP/s from 1024 rows on the 2-core AVX2 machine, where
this kernel holds 120-140; `pagedllm bench matmul`). The blocks are unpacked once (`QuantizedMatrix.unpack`, at load time) into the layout the
kernels read: the values (Q4_1's nibbles as the file packs them; Q8_0's bytes) and float32
scales and minimums.

With int8 activations (`int8_activations="auto"` or `"on"`, off by default), the products of up
to `QuantizedMatrix.int8_rows` rows quantize x to int8 per block of 32 and multiply on 8-bit
integers (csrc/quant_int8.cpp: VNNI's VPDPBUSD where the CPU has it, AVX2's VPMADDUBSW else).
Their outputs are close to float32's, not equal: `pagedllm bench dtype --dtypes float32
float32+int8` measures the greedy agreement. "auto" uses them only at the row counts where a
trial at start-up finds them faster than the float kernel (`int8_rows_that_pay`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch

from pagedllm.utils import best_wall_time

logger = logging.getLogger("pagedllm")

# GGML type -> bytes per block of 32 weights
QUANT_TYPES = {"Q8_0": 34, "Q4_1": 20}
BLOCK = 32
# The most rows of a decode-sized step: products of up to this many rows may run on int8
# activations, and steps of up to this many tokens run their layers in one C++ call
# (model/fused_layers.py). The float kernel itself serves any row count.
MAX_ROWS = 64


@dataclass
class Unpacked:
    values: torch.Tensor  # uint8: Q8_0 [out_features, in_features] int8 bits; Q4_1 [out_features, in_features / 2],
    # value j of a block in the low nibble of its byte j, value j + 16 in the high one
    scales: torch.Tensor  # float32 [out_features, in_features / 32]
    mins: torch.Tensor | None  # float32 [out_features, in_features / 32] (Q4_1), else None


@dataclass
class QuantizedMatrix:
    qtype: str  # a key of QUANT_TYPES
    data: torch.Tensor  # uint8 [out_features, in_features / 32 * bytes per block]
    in_features: int
    _unpacked: Unpacked | None = field(default=None, repr=False)
    int8_rows: int = 0  # products of up to this many rows run on int8 activations

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
                values = blocks[..., 4:20]  # value j in the low nibble of byte j, value j + 16 in the high
            else:
                mins, values = None, blocks[..., 2:34]
            self._unpacked = Unpacked(values.reshape(rows, -1).contiguous(), scales.contiguous(), mins)
        return self._unpacked


def _product(kernel: str, x: torch.Tensor, w: QuantizedMatrix) -> torch.Tensor:
    from pagedllm.kernels.build import load

    x = x.contiguous()
    u = w.unpack()
    y = torch.empty(x.shape[0], w.out_features, dtype=torch.float32)
    getattr(load(), kernel)(
        y.data_ptr(), x.data_ptr(), u.values.data_ptr(), u.scales.data_ptr(),
        u.mins.data_ptr() if u.mins is not None else None, x.shape[0], w.out_features, w.in_features,
        torch.get_num_threads(),
    )
    return y


def quantized_matmul(x: torch.Tensor, w: QuantizedMatrix) -> torch.Tensor:
    """x: [rows, in_features] float32 -> x W^T: [rows, out_features] float32; on int8
    activations when `w.int8_rows` covers the rows."""
    return _product("quant_matmul_int8" if x.shape[0] <= w.int8_rows else "quant_matmul_f32", x, w)


def float_matmul(x: torch.Tensor, w: QuantizedMatrix) -> torch.Tensor:
    """x W^T on float32 activations, whatever `w.int8_rows` says."""
    return _product("quant_matmul_f32", x, w)


def int8_matmul(x: torch.Tensor, w: QuantizedMatrix) -> torch.Tensor:
    """x W^T with x quantized to int8 per block of 32, whatever `w.int8_rows` says."""
    return _product("quant_matmul_int8", x, w)


INT8_ISA = {0: "portable C++", 1: "AVX2 VPMADDUBSW", 2: "AVX-VNNI VPDPBUSD", 3: "AVX512-VNNI VPDPBUSD"}
# The start-up trial of "auto": a projection of the default model's size, at the row counts of
# small and larger decode batches.
_TRIAL_SHAPE = (1536, 576)
_TRIAL_ROWS = (1, 4, 16, 64)


def int8_isa() -> str:
    from pagedllm.kernels.build import load

    return INT8_ISA[load().quant_int8_isa()]


def random_q4_1(out_features: int, in_features: int, generator: torch.Generator) -> QuantizedMatrix:
    """Q4_1 blocks of random values (scale 0.01, minimum 0): a weight of the given shape for timing
    the kernels."""
    blocks = torch.randint(0, 256, (out_features, in_features // BLOCK * QUANT_TYPES["Q4_1"]), dtype=torch.uint8,
                           generator=generator)
    blocks.view(out_features, -1, QUANT_TYPES["Q4_1"])[..., 0:4] = torch.tensor([0.01, 0.0], dtype=torch.float16).view(torch.uint8)
    return QuantizedMatrix("Q4_1", blocks, in_features)


@functools.cache
def int8_rows_that_pay() -> int:
    """The most rows up to which int8 activations beat the float kernel on a trial (Q4_1 blocks
    of `_TRIAL_SHAPE`, best of five timings at each of `_TRIAL_ROWS`, once per process): the
    largest trial row count that it wins along with every smaller one; 0 if it loses at 1."""
    out_features, in_features = _TRIAL_SHAPE
    gen = torch.Generator().manual_seed(0)
    w = random_q4_1(out_features, in_features, gen)
    pays, timings = 0, []
    for rows in _TRIAL_ROWS:
        x = torch.randn(rows, in_features, generator=gen)
        t_int8 = best_wall_time(lambda: int8_matmul(x, w), 5)
        t_float = best_wall_time(lambda: float_matmul(x, w), 5)
        timings.append(f"{rows} rows {t_int8 * 1e6:.0f} vs {t_float * 1e6:.0f} us")
        if t_int8 >= t_float:
            break
        pays = rows
    logger.info("int8 activations (%s): %s on a trial (%s)", int8_isa(),
                f"used up to {pays} rows" if pays else "not faster than float32, not used", "; ".join(timings))
    return pays
