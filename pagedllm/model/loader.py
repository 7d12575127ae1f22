"""Build a model with its weights loaded from a GGUF file or a Hugging Face folder (each
tensor-parallel rank reads its own slice), or mapped from the weight cache that the first load of
the file wrote. Finding the model and reading its architecture is `pagedllm.transformers_utils`'s
part."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch

from pagedllm.attention import AttentionBackend
from pagedllm.distributed import TensorParallelGroup
from pagedllm.model import weight_cache
from pagedllm.model.layers import prepare_linear_weights
from pagedllm.model.memory import process_rss
from pagedllm.model.interface import CausalLM
from pagedllm.model.registry import model_class
from pagedllm.model.weights import GGUFWeight, LazyWeight, SafetensorsWeight, gguf_tensors
from pagedllm.paths import model_cache_enabled
from pagedllm.transformers_utils.arch import ROPE_FACTOR_TENSORS, ModelArchConfig, gguf_metadata, load_arch_config
from pagedllm.transformers_utils.source import ModelSource
from pagedllm.utils import release_free_memory

logger = logging.getLogger("pagedllm")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}.")
    return DTYPES[dtype]


# --- GGUF -----------------------------------------------------------------------------------

def _gguf_weights(path: Path, model_cls: type, arch: ModelArchConfig, native: bool) -> Iterator[tuple[str, LazyWeight]]:
    """The file's tensors under the family's Hugging Face names (`gguf_to_hf_name`), as the
    checkpoint holds them (`gguf_weight`); with `native`, offering their blocks as the kernels
    read them (`GGUFWeight.load_native`)."""
    metadata = gguf_metadata(path)  # read once per process, and cached across runs
    permuted = arch.family.gguf_permuted_qk  # (the q/k rows of llama.cpp's llama architecture)
    for tensor in gguf_tensors(path, metadata["tensors"], metadata["byte_order"]):
        if tensor.name in ROPE_FACTOR_TENSORS:  # already read into the architecture
            continue
        hf_name = model_cls.gguf_to_hf_name(tensor.name)
        rotary = permuted and tensor.name.endswith(("attn_q.weight", "attn_k.weight"))
        weight = GGUFWeight(tensor, rotary_head_dim=arch.head_dim if rotary else None, native=native)
        yield hf_name, model_cls.gguf_weight(hf_name, weight)


# --- Hugging Face folder ----------------------------------------------------------------------

def _hf_weights(folder: Path, stack: ExitStack) -> Iterator[tuple[str, LazyWeight]]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"No *.safetensors files in {folder}.")
    for file in files:
        handle = stack.enter_context(safe_open(str(file), framework="pt"))
        for name in handle.keys():
            yield name, SafetensorsWeight(handle, name)


def keeps_gguf_blocks(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a GGUF file's quantized (and 16-bit) weights stay as stored: the kernels compute
    float32 products on a CPU; every other dtype or device dequantizes them at load."""
    return dtype == torch.float32 and device.type == "cpu"


def _load_from_source(model: CausalLM, source: ModelSource, native: bool) -> None:
    """Fill `model` from the checkpoint itself: each layer reads its slice (packed for the
    kernels with `native`, else dequantized)."""
    with ExitStack() as stack:
        if source.kind == "gguf":
            weights = _gguf_weights(source.path, type(model), model.cfg, native)
        else:
            weights = _hf_weights(source.path, stack)
        model.load_weights(weights)


def _log_growth(source: ModelSource, rss_before: int | None) -> None:
    """Log (at debug level) how much loading grew the process's resident memory, against the
    file's size. Not a measure of the weights (it counts whatever else loading allocated, and
    weights mapped from the weight cache are mostly not read in yet): the start-up summary
    gives their bytes (`memory.weight_bytes`)."""
    rss = process_rss()
    if rss is None or rss_before is None:
        return
    size = source.path.stat().st_size if source.kind == "gguf" else None
    against = f" for a {size / 2**30:.2f} GiB file ({(rss - rss_before) / size:.2f}x)" if size else ""
    logger.debug("Loading the weights grew the process by %.2f GiB%s", (rss - rss_before) / 2**30, against)


def load_model(
    source: ModelSource,
    max_position: int,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallelGroup = TensorParallelGroup(),
) -> CausalLM:
    """Build the model for `source` (the class its architecture names in `registry.MODELS`) and
    load this rank's share of its weights. A GGUF file's are mapped from the weight cache when it
    has an entry for this file and these settings, else read from the file and saved there (see
    `pagedllm.model.weight_cache`)."""
    start = time.perf_counter()
    rss_before = process_rss()
    arch = load_arch_config(source)
    model = model_class(arch.architecture)(arch, max_position, backend, tp, dtype)
    use_cache = source.kind == "gguf" and model_cache_enabled()
    entry = weight_cache.entry_path(source, dtype, device, tp) if use_cache else None
    checksum = weight_cache.load(model, entry) if entry is not None else None
    from_cache = checksum is not None
    if not from_cache:
        # Said before: reading (and for a GGUF, converting) a large file takes seconds to minutes.
        kept = "; kept in the weight cache for the next start" if entry is not None else ""
        logger.info("Reading the weights from %s%s...", source.path.name, kept)
        _load_from_source(model, source, keeps_gguf_blocks(dtype, device))
    model = model.to(device).eval()
    prepare_linear_weights(model)  # meanwhile, the cache file's checksum runs
    if from_cache and not checksum.passed():  # the entry is gone now: build it again
        return load_model(source, max_position, backend, dtype, device, tp)
    how = "from the weight cache" if from_cache else f"from {source.path.name}"
    if not from_cache:
        if entry is not None:
            try:
                built_from = {"model": str(source.path), "dtype": str(dtype), "tp": [tp.rank, tp.size],
                              "lineage": weight_cache.lineage(source, dtype, device, tp)}
                weight_cache.save(model, entry, built_from)
                how += ", saved to the weight cache"
                if device.type == "cpu":  # serve from the mapped file too: one copy, shared, pageable
                    checksum = weight_cache.load(model, entry, wait_for_checksum=True)
            except Exception as exc:  # a read-only or full disk...: the cache never fails a start
                logger.warning("Could not save the weight cache at %s: %s", entry, exc)
        release_free_memory()  # what building took (dequantized copies, parsers) goes back to the OS
    released = weight_cache.release_unread_pages(model) if checksum is not None else 0
    logger.info("Weights loaded %s in %.2f s%s", how, time.perf_counter() - start, f" ({entry})" if entry else "")
    _log_growth(source, rss_before)
    logger.debug("Handed back %.2f GiB of float pages that oneDNN's packed copies replace", released / 2**30)
    return model
