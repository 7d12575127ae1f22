"""Build and load pagedllm's CPU kernels (csrc/*.cpp): PagedAttention, quantized matmul and
the fused element-wise operators.

They are plain C++ with OpenMP and no torch headers, compiled once per machine with the system
compiler (about a minute, one source per core; logged before it starts) into one library in
the pagedllm cache folder and loaded with ctypes. `make setup` builds it ahead; otherwise the
first engine that needs it does.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

logger = logging.getLogger("pagedllm")

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
# fast-math lets the compiler reorder float sums; finite-math stays off because the softmax
# starts from -inf.
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-std=c++17", "-fPIC"]
# Linked without -ffast-math: with it, the linker adds crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process when the library loads, and every torch operator after it
# would compute subnormal floats as zero.
LINK_FLAGS = ["-shared", "-fPIC", "-fopenmp"]

_P = ctypes.c_void_p
_I32P = ctypes.POINTER(ctypes.c_int32)
_I64P = ctypes.POINTER(ctypes.c_int64)
_ATTENTION_ARGS = [
    _P, _P, _P, _P,  # out, query, key_cache, value_cache
    ctypes.c_int64, ctypes.c_int64,  # block_stride, head_stride (elements)
    _P, ctypes.c_int64,  # block_tables, block_table_stride
    _P, _P, _P, ctypes.c_int,  # item_seq, item_first_token, item_num_tokens, num_items
    _P,  # token_context
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # num_heads, num_kv_heads, head_dim, block_size
    ctypes.c_float, ctypes.c_int, ctypes.c_int,  # scale, fixed_partition_blocks, num_threads
]
# The _windowed entry points: the same, with a sliding window and a logit soft-cap (0: none)
# before num_threads.
_WINDOWED_ATTENTION_ARGS = _ATTENTION_ARGS[:-1] + [ctypes.c_int, ctypes.c_float, ctypes.c_int]
_WRITE_ARGS = [_P, _P, _P, _P, ctypes.c_int64, ctypes.c_int64, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]


def _machine_key() -> str:
    """The compiled library depends on the source, the flags and this CPU (-march=native)."""
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES + HEADERS))
    digest.update(" ".join(COMPILE_FLAGS + LINK_FLAGS).encode())
    digest.update(platform.machine().encode())
    try:
        with open("/proc/cpuinfo") as f:
            digest.update(next((line for line in f if line.startswith("flags")), "").encode())
    except OSError:
        pass
    return digest.hexdigest()[:16]


def library_path() -> Path:
    from pagedllm.paths import cache_dir

    return cache_dir() / "kernels" / f"pagedllm_kernels-{_machine_key()}.so"


def build(force: bool = False) -> Path:
    """Compile the kernel library if it is not built yet; returns its path."""
    path = library_path()
    if path.is_file() and not force:
        return path
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX) to build the CPU kernels")
    path.parent.mkdir(parents=True, exist_ok=True)
    jobs = max(1, min(len(SOURCES), os.cpu_count() or 1))
    # Said before it starts: the build takes about a minute (60 s on 2 shared cores, gguf_matmul.cpp
    # most of it) and nothing else is logged meanwhile.
    logger.info("Building the CPU kernels (first start on this machine or after the kernels changed; %d files "
                "with %s -O3 -march=native, %d at a time; about a minute)...", len(SOURCES), Path(compiler).name, jobs)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        staging = Path(tmp) / path.name
        objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        # The sources compile independently, one compiler per core; gguf_matmul.cpp, which
        # includes most headers and takes the longest, starts first, the others beside it.
        commands = [[compiler, *COMPILE_FLAGS, "-c", str(source), "-o", str(obj)] for source, obj in zip(SOURCES, objects)]
        commands.sort(key=lambda command: Path(command[-3]).name != "gguf_matmul.cpp")
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            list(pool.map(_run, commands))
        _run([compiler, *LINK_FLAGS, *map(str, objects), "-o", str(staging)])
        os.replace(staging, path)
    logger.info("Built the CPU kernels in %.1f s: %s", time.perf_counter() - start, path)
    return path


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building the CPU kernels failed:\n{result.stderr[-2000:]}")


@functools.cache
def load() -> ctypes.CDLL:
    # torch is loaded first, so the library shares torch's OpenMP runtime (same soname).
    import torch  # noqa: F401

    lib = ctypes.CDLL(str(build()))
    for types in ("f32_f32", "bf16_bf16", "f32_bf16"):
        getattr(lib, f"paged_attention_{types}").argtypes = _ATTENTION_ARGS
        getattr(lib, f"paged_attention_{types}").restype = None
        getattr(lib, f"paged_attention_{types}_windowed").argtypes = _WINDOWED_ATTENTION_ARGS
        getattr(lib, f"paged_attention_{types}_windowed").restype = None
        getattr(lib, f"write_kv_{types}").argtypes = _WRITE_ARGS
        getattr(lib, f"write_kv_{types}").restype = None
    # kernels/gguf.py: the native GGUF block types
    lib.gguf_matmul.argtypes = [ctypes.c_int, _P, _P, _P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.gguf_dequantize_rows.argtypes = [ctypes.c_int, _P, _P, _P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.gguf_quantize_activations.argtypes = [ctypes.c_int, _P, _P, _P, ctypes.c_int64, ctypes.c_int64]
    for name in ("gguf_matmul", "gguf_quantize_activations"):
        getattr(lib, name).restype = None
    lib.gguf_read_sum.argtypes = [_P, ctypes.c_int64, ctypes.c_int]
    lib.gguf_dequantize_rows.restype = ctypes.c_int
    lib.gguf_read_sum.restype = ctypes.c_uint64
    lib.gguf_int8_peak.argtypes = [ctypes.c_int64, ctypes.c_int]
    lib.gguf_int8_peak.restype = ctypes.c_int64
    lib.gguf_set_isa.argtypes = [ctypes.c_int]
    lib.gguf_set_int8_way.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    lib.gguf_set_int8_way.restype = ctypes.c_int
    lib.gguf_int8_way.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.gguf_int8_way.restype = ctypes.c_int
    lib.gguf_set_int8_way_for_width.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.gguf_set_int8_way_for_width.restype = ctypes.c_int
    lib.gguf_int8_way_for_width.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    lib.gguf_int8_way_for_width.restype = ctypes.c_int
    lib.gguf_set_row_streams.argtypes = [ctypes.c_int]
    lib.gguf_set_prefetch.argtypes = [ctypes.c_int]
    for name in ("gguf_isa", "gguf_best_isa", "gguf_set_isa", "gguf_set_row_streams", "gguf_row_streams",
                 "gguf_set_prefetch", "gguf_prefetch"):
        getattr(lib, name).restype = ctypes.c_int
    lib.decoder_layers_f32.argtypes = [_P, ctypes.c_int, _P, _P, _P, _P, _P, _P]
    lib.decoder_layers_f32.restype = ctypes.c_int
    lib.advance_decode_inputs.argtypes = [_P, ctypes.c_int64, _P, _P, ctypes.c_int64]
    lib.advance_decode_inputs.restype = None
    lib.decoder_layers_num_parts.restype = ctypes.c_int
    lib.moe_layer_f32.argtypes = [_P, _P, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.moe_layer_f32.restype = None
    for suffix in ("f32", "bf16"):
        getattr(lib, f"fused_add_rms_norm_{suffix}").argtypes = [_P, _P, _P, _P, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int]
        getattr(lib, f"rotary_neox_{suffix}").argtypes = [_P, ctypes.c_int64, _P, _P, _P] + [ctypes.c_int] * 5
        getattr(lib, f"silu_and_mul_{suffix}").argtypes = [_P, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        for name in ("fused_add_rms_norm", "rotary_neox", "silu_and_mul"):
            getattr(lib, f"{name}_{suffix}").restype = None
    lib.gelu_tanh_and_mul_f32.argtypes = [_P, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.gelu_tanh_and_mul_f32.restype = None
    lib.logsumexp_rows_f32.argtypes = [_P, _P, _P, _P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.sample_rows_f32.argtypes = [_P, _P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, _P, _P, ctypes.c_int]
    lib.sample_filtered_rows_f32.argtypes = [_P, _P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, _P, _P, _P, _P, _P,
                                             ctypes.c_int]
    lib.top_logprobs_rows_f32.argtypes = [_P, _P, _P, _P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, _P, _P,
                                          ctypes.c_int, ctypes.c_int]
    lib.gguf_matmul_sample.argtypes = [ctypes.c_int, _P, _P, _P, ctypes.c_int64, ctypes.c_int, ctypes.c_int64,
                                       ctypes.c_int64, ctypes.c_int, ctypes.c_int, _P, _P, _P, _P, _P, _P, _P, _P]
    for name in ("logsumexp_rows_f32", "sample_rows_f32", "sample_filtered_rows_f32", "top_logprobs_rows_f32",
                 "gguf_matmul_sample"):
        getattr(lib, name).restype = None
    return lib


def available() -> bool:
    try:
        load()
        return True
    except (RuntimeError, OSError) as exc:
        logger.warning("The CPU kernels are unavailable (%s); using plain torch paths.", exc)
        return False


if __name__ == "__main__":  # `python -m pagedllm.kernels.build`: build ahead of time
    logging.basicConfig(level=logging.INFO)
    print(build())
