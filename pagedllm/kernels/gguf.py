"""Matrix products computed directly from GGUF's block types: the legacy Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0 (blocks of 32 weights), the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (super-blocks of 256) and
the non-linear IQ4_NL (blocks of 32) and IQ4_XS (256), the types llama.cpp's files hold (its
Q4_K_M is Q4_K and Q6_K, with Q5_0/Q8_0 where a row is not a multiple of 256; Q3_K_M and Q2_K add
Q3_K and Q2_K; the imatrix quants IQ4_XS/IQ4_NL).

A weight is kept as a `PackedWeight`: the file's rows of blocks, as they are (`pack`), and
nothing else: no float copy, scales included, `.data` about the file's size, saved as-is by the
weight cache (`from_data` rebuilds it). `LAYOUT` names that layout, for a cache to key on.

`matmul` runs csrc/gguf_matmul.cpp (its top comment says how): float32 activations, or with
`int8=True` activations quantized per block of 32 for the legacy types and per 256 for the
K-quants (llama.cpp's Q8_0 and Q8_K ways) multiplied on 8-bit integers (AVX-512 VNNI or AVX2); on CPUs with AMX (path 'amx'), float32 products of 8 to 31
rows of the types with one scale per 32 weights run on its tiles with exact operands
(csrc/amx_exact.h), those of 32 rows and more carried as two bfloat16 halves (csrc/gguf_amx.h),
and int8 products of 5 rows and more (10 for Q6_K) on its int8 tiles (csrc/gguf_amx_int8.h; Q4_K
and Q5_K with their sub-block scales folded into the weights, csrc/gguf_amx_q8k.h). The path is the
best this CPU has (`isa()`); `set_isa` forces a lesser one (tests check each, the benchmark
compares them), as does the environment variable PAGEDLLM_GGUF_ISA (portable, avx2, avx512,
amx) read at first use. The C ABI `gguf_matmul` is the
same entry point, for the fused decoder (csrc/decoder_layers.cpp).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

# name -> (weights per block, bytes per block)
GGUF_TYPES: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "IQ4_NL": (32, 18),
    "IQ4_XS": (256, 136),
}
# The C ABI's qtype id of each: ggml's GGMLQuantizationType values.
TYPE_IDS: dict[str, int] = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14,
                            "Q2_K": 10, "Q3_K": 11, "IQ4_NL": 20, "IQ4_XS": 23}
# The layout of PackedWeight.data: "rows-1" is the file's rows of blocks, unchanged. A weight
# cache keys its entries on it, so a later layout (interleaved rows) never reads an old one.
LAYOUT = "rows-1"
# The most rows of a decode-sized step: int8_activations="on" multiplies products of up to this
# many rows on int8 activations, and steps of up to this many tokens run their layers in one C++
# call (model/fused_layers.py). The kernels themselves serve any row count.
MAX_ROWS = 64
ISAS = {0: "portable", 1: "avx2", 2: "avx512", 3: "amx"}
ISA_NAMES = {"portable": "portable C++", "avx2": "AVX2 (FMA, VPMADDUBSW)", "avx512": "AVX-512 VNNI (VPDPBUSD)",
             "amx": "AVX-512 VNNI, prompts on AMX-BF16 tiles (TDPBF16PS), int8 batches on AMX-INT8 (TDPBUSD)"}


@dataclass
class PackedWeight:
    qtype: str  # a key of GGUF_TYPES
    out_features: int
    in_features: int
    data: torch.Tensor  # uint8 [out_features, in_features // weights per block * bytes per block]

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _check_type(qtype: str) -> tuple[int, int]:
    if qtype not in GGUF_TYPES:
        raise ValueError(f"qtype {qtype!r} is not a native GGUF type (one of {', '.join(GGUF_TYPES)})")
    return GGUF_TYPES[qtype]


def _row_bytes(qtype: str, in_features: int) -> int:
    weights, nbytes = _check_type(qtype)
    if in_features <= 0 or in_features % weights:
        raise ValueError(f"in_features {in_features} is not a positive multiple of {qtype}'s block of {weights} weights")
    return in_features // weights * nbytes


def pack(qtype: str, raw: torch.Tensor, in_features: int) -> PackedWeight:
    """The kernels' weight from a GGUF tensor's raw blocks, raw: uint8 [out_features, row bytes]
    (or flat); the bytes are kept as they are (copied only to make them contiguous)."""
    row_bytes = _row_bytes(qtype, in_features)
    if raw.dtype != torch.uint8:
        raise ValueError(f"raw blocks of a {qtype} weight must be uint8, got {raw.dtype}")
    if raw.numel() % row_bytes:
        raise ValueError(f"raw blocks of {raw.numel()} bytes are not whole {qtype} rows of {in_features} weights ({row_bytes} bytes)")
    data = raw.reshape(-1, row_bytes).contiguous()
    return PackedWeight(qtype, data.shape[0], in_features, data)


def from_data(qtype: str, out_features: int, in_features: int, data: torch.Tensor) -> PackedWeight:
    """A PackedWeight from a cached `.data` (as `pack` made it)."""
    row_bytes = _row_bytes(qtype, in_features)
    if data.dtype != torch.uint8 or data.numel() != out_features * row_bytes:
        raise ValueError(f"cached data of {data.numel()} {data.dtype} is not a {qtype} [{out_features}, {in_features}] weight")
    return PackedWeight(qtype, out_features, in_features, data.reshape(out_features, row_bytes).contiguous())


@functools.cache
def _lib():
    """The kernel library, its ISA forced first where PAGEDLLM_GGUF_ISA says (once: every
    product of every step calls this)."""
    from pagedllm.kernels.build import load

    lib = load()
    forced = os.environ.get("PAGEDLLM_GGUF_ISA")
    if forced:
        _set_isa(lib, forced)
    return lib


def _set_isa(lib, name: str) -> None:
    ids = {v: k for k, v in ISAS.items()}
    if name not in ids:
        raise ValueError(f"PAGEDLLM_GGUF_ISA / isa {name!r} is not one of {', '.join(ids)}")
    if lib.gguf_set_isa(ids[name]) != 0:
        raise ValueError(f"isa {name!r} is not built on this CPU (the best is {ISAS[lib.gguf_best_isa()]})")


def matmul(x: torch.Tensor, w: PackedWeight, int8: bool = False) -> torch.Tensor:
    """x: float32 [rows, in_features] -> x W^T: float32 [rows, out_features]; int8: x quantized
    per block of `activation_block(w.qtype)` and multiplied on 8-bit integers (close to, not equal to, the float product)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be float32 [rows, {w.in_features}], got {x.dtype} {list(x.shape)}")
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.out_features, dtype=torch.float32)
    if x.shape[0]:
        _lib().gguf_matmul(TYPE_IDS[w.qtype], y.data_ptr(), x.data_ptr(), w.data.data_ptr(), x.shape[0], w.out_features,
                           w.in_features, torch.get_num_threads(), int(int8))
    return y


class Draws(NamedTuple):
    """Each row's draw of `matmul_sample`, all [rows]: top_k 0 for a greedy row (its other values
    unread), else 0 < top_k < out_features with the row's temperature, top_p (1: none), min_p
    (0: none) and uniform number in [0, 1), as `ops.sample_filtered_rows` takes them."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32
    uniform: torch.Tensor  # float32


_DRAW_DTYPES = (torch.float32, torch.int64, torch.float32, torch.float32, torch.float32)


def matmul_sample(
    x: torch.Tensor, w: PackedWeight, int8: bool = False, draws: Draws | None = None, logits: bool = True
) -> tuple[torch.Tensor | None, list[int], list[float]]:
    """(matmul(x, w, int8), each row's token, its log-probability), the logits' parts reduced as
    soon as the product wrote them rather than read back from memory afterwards (an LM head's
    decode step). A greedy row (every row without `draws`) gives what `ops.greedy_rows` gives of
    the product, bitwise; a top-k row the token `ops.sample_filtered_rows` draws from it and its
    log-probability from `ops.logsumexp_rows`, as the sampler reports them. With logits=False the
    product goes to a buffer kept for the next call (`_logits_scratch`), and None comes back in its
    place; the tokens and log-probabilities come back through ctypes arrays, not tensors: a decode
    step calls this right after its layers have streamed the weights through the caches, where
    every call into torch fetches its code again."""
    _check_sample_inputs(x, w, draws)
    rows = x.shape[0]
    y = torch.empty(rows, w.out_features, dtype=torch.float32) if logits else None
    if not rows:
        return y, [], []
    if not x.is_contiguous():
        x = x.contiguous()
    out = y if y is not None else _logits_scratch(rows * w.out_features)
    return (y, *_SampleCall(x, w, int8, out, draws)())


def greedy_sampler(x: torch.Tensor, w: PackedWeight, int8: bool = False) -> Callable[[], tuple[list[int], list[float]]]:
    """A call giving what `matmul_sample(x, w, int8, logits=False)` gives of greedy rows, for x's
    contents at the time of the call: its addresses taken now, so that a decode step, which
    samples from the same hidden-state buffer each step (`FusedDecoderLayers.run_steady`), makes
    no torch call (x must be contiguous, and stay alive and unresized while the call is used)."""
    _check_sample_inputs(x, w, None)
    if not x.is_contiguous() or not x.shape[0]:
        raise ValueError("greedy_sampler needs a contiguous x of at least one row")
    return _SampleCall(x, w, int8, _logits_scratch(x.shape[0] * w.out_features), None)


def _check_sample_inputs(x: torch.Tensor, w: PackedWeight, draws: Draws | None) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"x must be float32 [rows, {w.in_features}], got {x.dtype} {list(x.shape)}")
    rows = x.shape[0]
    if draws is not None and (
        any(t.shape != (rows,) or not t.is_contiguous() or t.dtype != dtype for t, dtype in zip(draws, _DRAW_DTYPES))
        or not bool(((draws.top_k >= 0) & (draws.top_k < w.out_features)).all())
    ):
        raise ValueError(f"draws must hold [{rows}] contiguous tensors of {[str(d) for d in _DRAW_DTYPES]}, "
                         f"top_k in [0, {w.out_features})")


class _SampleCall:
    """One `gguf_matmul_sample` call's arguments, kept: calling it runs the product over the
    inputs' current contents and returns (each row's token, its log-probability)."""

    def __init__(self, x: torch.Tensor, w: PackedWeight, int8: bool, out: torch.Tensor, draws: Draws | None) -> None:
        rows = x.shape[0]
        self.tokens, self.logprobs = (ctypes.c_int64 * rows)(), (ctypes.c_float * rows)()
        filters = [t.data_ptr() for t in draws] if draws is not None else [None] * 5
        self.head = (TYPE_IDS[w.qtype], out.data_ptr(), x.data_ptr(), w.data.data_ptr(), w.data.shape[1], rows,
                     w.out_features, w.in_features)
        self.tail = (int(int8), (ctypes.c_float * rows)(), self.tokens, self.logprobs, *filters)
        self.held = (x, w, out, draws)  # (what the addresses point into)

    def __call__(self) -> tuple[list[int], list[float]]:
        _lib().gguf_matmul_sample(*self.head, torch.get_num_threads(), *self.tail)
        return list(self.tokens), list(self.logprobs)


# The most floats `_logits_scratch` keeps between calls (a larger product allocates its own).
_SCRATCH_FLOATS = 4 << 20
_scratch = threading.local()  # (each thread its own: engines may step in threads side by side)


def _logits_scratch(floats: int) -> torch.Tensor:
    """`floats` float32s (at least) for logits nobody keeps: this thread's kept buffer, grown as
    needed up to _SCRATCH_FLOATS; a larger product gets one of its own."""
    if floats > _SCRATCH_FLOATS:
        return torch.empty(floats, dtype=torch.float32)
    buffer = getattr(_scratch, "logits", None)
    if buffer is None or buffer.numel() < floats:
        buffer = _scratch.logits = torch.empty(floats, dtype=torch.float32)
    return buffer


def dequantize_rows(w: PackedWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [n, in_features]: the rows `rows` of W (all if None), exactly as
    `gguf.quants.dequantize` gives them (an embedding lookup from a quantized token table)."""
    if rows is None:
        rows = torch.arange(w.out_features)
    if rows.dtype != torch.int64 or rows.dim() != 1 or not rows.is_contiguous():  # (a step's input ids are)
        rows = rows.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(rows.numel(), w.in_features, dtype=torch.float32)
    if rows.numel() and _lib().gguf_dequantize_rows(TYPE_IDS[w.qtype], out.data_ptr(), w.data.data_ptr(), rows.data_ptr(),
                                                    rows.numel(), w.out_features, w.in_features, torch.get_num_threads()):
        raise ValueError(f"rows must be in [0, {w.out_features})")
    return out


def activation_block(qtype: str) -> int:
    """How many activations share one int8 scale in a product with W of `qtype`: 256 for the
    K-quants (llama.cpp's Q8_K: a super-block's sub-block scales then apply to integer sums), 32
    for the legacy types."""
    return 256 if GGUF_TYPES[qtype][0] == 256 else 32


def quantize_activations(x: torch.Tensor, qtype: str = "Q8_0") -> tuple[torch.Tensor, torch.Tensor]:
    """x as the int8 path quantizes it for a product with W of `qtype`: int8 [rows, in] and the
    scales float32 [rows, in / 32], each block's scale repeated over its 32s (x ~= q * scale per
    32): for tests."""
    if qtype not in GGUF_TYPES:
        raise ValueError(f"Unknown GGUF type {qtype!r}; choose one of {', '.join(GGUF_TYPES)}.")
    x = x.contiguous()
    if x.shape[1] % activation_block(qtype):
        raise ValueError(f"{qtype} quantizes activations per {activation_block(qtype)}: x has {x.shape[1]} columns.")
    q = torch.empty(x.shape, dtype=torch.int8)
    d = torch.empty(x.shape[0], x.shape[1] // 32, dtype=torch.float32)
    _lib().gguf_quantize_activations(TYPE_IDS[qtype], q.data_ptr(), d.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1])
    return q, d


def read_bandwidth(megabytes: int = 1024, threads: int | None = None, repeats: int = 5) -> float:
    """Bytes per second read from memory the way the products read a weight (each thread its share
    in `row_streams()` interleaved runs, prefetched; `megabytes` well past the caches): the best of `repeats`
    passes, by the wall clock. The bound the one-row products are measured against."""
    import time

    lib = _lib()
    threads = threads or torch.get_num_threads()
    buf = torch.ones(megabytes << 20, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats + 1):  # (the first pass faults the pages in)
        start = time.perf_counter()
        lib.gguf_read_sum(buf.data_ptr(), buf.numel() // 256 * 256, threads)
        best = min(best, time.perf_counter() - start)
    return buf.numel() // 256 * 256 / best


def int8_peak(threads: int | None = None, seconds: float = 0.2) -> float:
    """The machine's int8 multiply-adds per second on this path's widest int8 instruction
    (VPDPBUSD on AVX-512 VNNI, VPMADDUBSW on AVX2): 8 independent chains on each of `threads`
    threads (default torch's), timed by the wall clock for about `seconds`; 0 on the portable
    path. The bound the int8 products are measured against (`pagedllm bench gguf-kernels`)."""
    import time

    lib = _lib()
    threads = threads or torch.get_num_threads()
    iterations = 1 << 16
    while True:
        start = time.perf_counter()
        done = lib.gguf_int8_peak(iterations, threads)
        elapsed = time.perf_counter() - start
        if done == 0:
            return 0.0
        if elapsed >= seconds:
            return done / elapsed
        iterations *= 2 if elapsed > seconds / 8 else 8


# The int8 ways a path can run: its own first, then the AVX2 way (kernels/csrc/gguf_int8_avx2.h),
# which AVX-512 and AMX CPUs run too, and the AVX2 way with every row of x alone ("avx2_rows": W
# decoded in registers once and taken by each row, where the interleaved groups' buffer costs more
# than it saves at a few rows).
INT8_WAYS = {"portable": ["portable"], "avx2": ["avx2", "avx2_rows"], "avx512": ["vnni", "avx2", "avx2_rows"],
             "amx": ["amx", "avx2", "avx2_rows"]}
_WAY_CODES = {"avx2_rows": 2}  # the C side's Int8Way; a path's own way is 0, the AVX2 way elsewhere 1
# The types only the AVX2 int8 way decodes (every SIMD path runs it for them).
AVX2_INT8_ONLY = ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS")
# The row counts whose int8 way is chosen together (the C side's buckets): 1, 2-3, 4-7, ..., 64+.
INT8_WAY_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def int8_ways(qtype: str | None = None) -> list[str]:
    """The int8 ways this path can run, its own first (`set_int8_way` chooses among them); with
    `qtype`, those that can multiply that type (the AVX2 ones only for AVX2_INT8_ONLY)."""
    ways = INT8_WAYS[isa()]
    return [w for w in ways if w.startswith("avx2")] if qtype in AVX2_INT8_ONLY else list(ways)


def _way_code(way: str) -> int:
    return _WAY_CODES.get(way, 0 if way == INT8_WAYS[isa()][0] else 1)


def set_int8_way(qtype: str, rows: int, way: str | None, in_features: int | None = None) -> None:
    """Run int8 products of `qtype` with `rows` rows (and every row count in its bucket of
    INT8_WAY_BUCKETS) by `way`, one of `int8_ways()`: a measurement's choice (the start-up trial,
    model/quant/int8_trial.py), never a fixed table. The types the VNNI and AMX ways do not decode
    (AVX2_INT8_ONLY) choose among the AVX2 ways only (`int8_ways(qtype)`). With `in_features`,
    only products whose rows are that wide (None as the way: they take the type's way again)."""
    if TYPE_IDS.get(qtype) is None or rows < 1:
        raise ValueError(f"set_int8_way needs a GGUF type and rows >= 1, got {qtype!r}, {rows}")
    ways = int8_ways(qtype)
    if way not in ways and not (way is None and in_features is not None):
        raise ValueError(f"int8 way {way!r} is not one of this path's for {qtype} ({', '.join(ways)})")
    if len(ways) < 2:
        return
    if in_features is None:
        _lib().gguf_set_int8_way(TYPE_IDS[qtype], rows, _way_code(way))
    elif _lib().gguf_set_int8_way_for_width(TYPE_IDS[qtype], in_features, rows, -1 if way is None else _way_code(way)):
        raise ValueError(f"cannot set an int8 way for {qtype} rows of {in_features} (a table of 64 widths)")


def int8_way(qtype: str, rows: int, in_features: int | None = None) -> str:
    """The int8 way products of `qtype` with `rows` rows (`in_features` wide: that width's way
    where one was set) run by now."""
    ways = int8_ways(qtype)
    if len(ways) == 1:
        return ways[0]
    if in_features is None:
        code = _lib().gguf_int8_way(TYPE_IDS[qtype], rows)
    else:
        code = _lib().gguf_int8_way_for_width(TYPE_IDS[qtype], in_features, rows)
    return next((w for w in ways if _way_code(w) == code), ways[0])  # (an AVX2-only type's 0 is "avx2")


def isa() -> str:
    """The path this process runs: 'amx' (AVX-512 VNNI, prompts on AMX tiles), 'avx512' (AVX-512
    with VNNI), 'avx2' or 'portable'."""
    return ISAS[_lib().gguf_isa()]


def available_isas() -> list[str]:
    """Every path this build can run, best last."""
    return [ISAS[i] for i in range(_lib().gguf_best_isa() + 1)]


def set_isa(name: str | None) -> None:
    """Force a path (one of available_isas()); None: the best."""
    lib = _lib()
    _set_isa(lib, name if name is not None else ISAS[lib.gguf_best_isa()])


# The interleaved runs a thread may read its rows of W in (csrc/gguf_common.h's kMaxStreams).
MAX_ROW_STREAMS = 8


def set_row_streams(streams: int) -> None:
    """Read each thread's rows of W in `streams` interleaved runs (the hardware prefetchers follow
    that many streams): a measurement's choice per machine (model/quant/read_trial.py's
    `choose_read_way`). The products' results do not change, only the order rows are read in."""
    if not 1 <= streams <= MAX_ROW_STREAMS or _lib().gguf_set_row_streams(streams):
        raise ValueError(f"row streams must be 1 to {MAX_ROW_STREAMS}, got {streams}")


def row_streams() -> int:
    """The interleaved runs each thread reads its rows of W in (`set_row_streams`)."""
    return _lib().gguf_row_streams()


# The software prefetch hints of the weight stream (csrc/gguf_common.h's PrefetchHint), by code.
PREFETCH_HINTS = ("nta", "t0")


def set_prefetch(hint: str) -> None:
    """Prefetch the weight stream with `hint`: "nta" (PREFETCHNTA, the lines kept out of the outer
    caches) or "t0" (PREFETCHT0): a measurement's choice per machine (model/quant/read_trial.py's
    `choose_read_way`). The products' results do not change, only how fast rows arrive."""
    if hint not in PREFETCH_HINTS or _lib().gguf_set_prefetch(PREFETCH_HINTS.index(hint)):
        raise ValueError(f"prefetch hint must be one of {', '.join(PREFETCH_HINTS)}, got {hint!r}")


def prefetch() -> str:
    """The weight stream's software prefetch hint (`set_prefetch`)."""
    return PREFETCH_HINTS[_lib().gguf_prefetch()]


# Where each type keeps its float16 scales (byte offset in a block, uniform range): random bytes
# elsewhere are valid values, so random blocks with these scales are finite, sane weights.
_SCALE_FIELDS = {
    "Q4_0": [(0, -0.02, 0.02)],
    "Q4_1": [(0, 0.001, 0.02), (2, -0.1, 0.1)],
    "Q5_0": [(0, -0.02, 0.02)],
    "Q5_1": [(0, 0.001, 0.01), (2, -0.1, 0.1)],
    "Q8_0": [(0, -0.001, 0.001)],
    "Q4_K": [(0, 0.0002, 0.002), (2, 0.0002, 0.002)],
    "Q5_K": [(0, 0.0001, 0.001), (2, 0.0001, 0.001)],
    "Q6_K": [(208, 0.00005, 0.0005)],
    "Q2_K": [(80, 0.0002, 0.002), (82, 0.0002, 0.002)],
    "Q3_K": [(108, 0.00005, 0.0005)],
    "IQ4_NL": [(0, 0.0002, 0.002)],
    "IQ4_XS": [(0, 0.00001, 0.0001)],
}


def random_weight(qtype: str, out_features: int, in_features: int, generator: torch.Generator | None = None) -> PackedWeight:
    """A weight of random blocks (random values, float16 scales in a sane range): for tests and
    the benchmark."""
    weights, nbytes = _check_type(qtype)
    num_blocks = out_features * (_row_bytes(qtype, in_features) // nbytes)
    raw = torch.randint(0, 256, (num_blocks, nbytes), dtype=torch.uint8, generator=generator)
    for offset, low, high in _SCALE_FIELDS[qtype]:
        scale = torch.rand(num_blocks, generator=generator) * (high - low) + low
        raw[:, offset:offset + 2] = scale.to(torch.float16).view(torch.uint8).view(num_blocks, 2)
    return pack(qtype, raw.view(out_features, -1), in_features)
