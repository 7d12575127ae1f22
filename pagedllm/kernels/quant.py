"""Matrix products with weights from their GGUF block quantization (Q4_1, Q8_0): the kernels
`quant.GGUFLinear` runs for these two types (`LegacyPacked`, the API of kernels/gguf.py;
gguf.py serves every other type). Every float32 product on a CPU of such a weight multiplies
from its blocks (csrc/quant_matmul.cpp):
with a few rows of input (sequences decoding together) reading the quantized values (0.75 bytes
per Q4_1 weight, against 4 for float32) and expanding them on the fly beats the float product,
and with many (prompts) its tiled way runs at about the float products' rate or above (oneDNN's
packed product falls to about 70-85 GFLOP/s from 1024 rows on the 2-core AVX2 machine, where
this kernel holds 120-140; `pagedllm bench matmul`). The blocks are unpacked once (`QuantizedMatrix.unpack`, at load time) into the layout the
kernels read: the values (Q4_1's nibbles as the file packs them; Q8_0's bytes) and float32
scales and minimums.

With int8 activations (`int8_activations="auto"`, a GGUF model's default on a CPU, or "on"),
the products of up to `QuantizedMatrix.int8_rows` rows quantize x to int8 per block of 32 and multiply on 8-bit
integers (csrc/quant_int8.cpp: VNNI's VPDPBUSD where the CPU has it, AVX2's VPMADDUBSW else).
Their outputs are close to float32's, not equal: `pagedllm bench dtype --dtypes float32
float32+int8` measures the greedy agreement. "auto" uses them only at the row counts where a
trial finds them faster than the float kernel (`int8_rows_that_pay`, run once per machine:
model/quant/int8_trial.py keeps its result in the cache folder).
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


# --- the kernels' API of kernels/gguf.py, for the two types these kernels serve -----------------
# `quant.GGUFLinear` multiplies Q4_1 and Q8_0 weights with these kernels rather than
# gguf.py's while they are faster on the default model's shapes (measured: about 1.8x at 1 row,
# 2.3x at 8 rows on the 2-core Zen 5 machine, Q4_1 576-3072 x 576-1536). The weight is kept
# unpacked (`QuantizedMatrix.unpack`), flat: the values, the float32 scales, the minimums: 1.2x
# Q4_1's file bytes, 1.06x Q8_0's.

TYPE_IDS = {"Q4_1": 3, "Q8_0": 8}  # ggml's ids, as quant_matmul_packed reads them


@dataclass
class LegacyPacked:
    qtype: str  # a key of QUANT_TYPES
    out_features: int
    in_features: int
    data: torch.Tensor  # uint8, flat: values, then scales (float32), then minimums (float32, Q4_1)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def pack(qtype: str, raw: torch.Tensor, in_features: int) -> LegacyPacked:
    """The layout of these kernels from a GGUF tensor's raw blocks, raw: uint8 [out_features, row bytes]."""
    u = QuantizedMatrix(qtype, raw.reshape(raw.shape[0], -1), in_features).unpack()
    parts = [u.values, u.scales.view(torch.uint8)] + ([u.mins.view(torch.uint8)] if u.mins is not None else [])
    return LegacyPacked(qtype, raw.shape[0], in_features, torch.cat([p.reshape(-1) for p in parts]))


def from_data(qtype: str, out_features: int, in_features: int, data: torch.Tensor) -> LegacyPacked:
    expected = out_features * in_features * (24 if qtype == "Q4_1" else 36) // 32
    if data.dtype != torch.uint8 or data.numel() != expected:
        raise ValueError(f"cached data of {data.numel()} {data.dtype} is not a {qtype} [{out_features}, {in_features}] weight")
    return LegacyPacked(qtype, out_features, in_features, data.reshape(-1))


def _split(w: LegacyPacked) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """values [out, bytes per row], scales and minimums [out, in / 32]."""
    n, k = w.out_features, w.in_features
    value_bytes = n * k // 2 if w.qtype == "Q4_1" else n * k
    scales = w.data[value_bytes : value_bytes + n * k // 8].view(torch.float32).view(n, -1)
    mins = w.data[value_bytes + n * k // 8 :].view(torch.float32).view(n, -1) if w.qtype == "Q4_1" else None
    return w.data[:value_bytes].view(n, -1), scales, mins


@functools.cache
def _packed_lib():
    import ctypes

    from pagedllm.kernels.build import load

    lib = load()
    lib.quant_matmul_packed.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.quant_matmul_packed.restype = None
    return lib


def matmul(x: torch.Tensor, w: LegacyPacked, int8: bool = False) -> torch.Tensor:
    """x: float32 [rows, in_features] -> x W^T: float32 [rows, out_features] (int8: on int8 activations)."""
    from pagedllm.kernels.gguf import packed_product

    return packed_product(_packed_lib().quant_matmul_packed, x, w, TYPE_IDS[w.qtype], int8)


def dequantize_rows(w: LegacyPacked, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [n, in_features]: rows `rows` of W (all if None), as gguf.quants.dequantize gives them."""
    values, scales, mins = _split(w)
    if rows is not None:
        rows = rows.reshape(-1).long()
        values, scales, mins = values[rows], scales[rows], mins[rows] if mins is not None else None
    n = values.shape[0]
    if w.qtype == "Q8_0":
        q = values.view(torch.int8).float().view(n, -1, BLOCK)
        return (q * scales.unsqueeze(-1)).reshape(n, w.in_features)
    b = values.reshape(n, -1, 16)
    q = torch.cat([b & 15, b >> 4], dim=-1).float()
    return (q * scales.unsqueeze(-1) + mins.unsqueeze(-1)).reshape(n, w.in_features)


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


FLOAT_ISA = {0: "portable C++", 1: "AVX2", 2: "AVX-512", 3: "AVX-512 and AMX"}


def float_isa() -> str:
    """The float kernel's way on this build: with AVX-512, every product of up to 64 rows expands
    each block once for up to 8 rows of x and two rows of W; with AVX2, 1-7 rows do so for up to 8
    rows of x (for Q4_1 two rows of W at 1-4), and from 8 rows on the tiled way runs. Where the
    CPU has AMX (and Linux grants it), products of `amx_min_rows()` rows and more run on its
    tiles instead (csrc/quant_amx.h over csrc/amx_exact.h: exact operands, float32 sums)."""
    from pagedllm.kernels.build import load

    return FLOAT_ISA[load().quant_matmul_isa()]


def amx_min_rows() -> int:
    """The fewest rows of x whose float products run on AMX tiles now; 0 if none do."""
    from pagedllm.kernels.build import load

    return load().quant_matmul_amx_min_rows()


def set_amx(on: bool) -> bool:
    """Turns the AMX way of the float products on or off (tests, benchmarks); False if this build
    or CPU cannot turn it on."""
    from pagedllm.kernels.build import load

    return load().quant_matmul_set_amx(int(on)) == 0


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
