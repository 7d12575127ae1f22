"""Build a model with its weights loaded from a GGUF file or a Hugging Face folder (each
tensor-parallel rank reads its own slice), or mapped from the weight cache that the first load of
the file wrote. Finding the model and reading its architecture is `pagedllm.transformers_utils`'s
part."""

from __future__ import annotations

import ctypes
import logging
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch

from pagedllm.attention import AttentionBackend
from pagedllm.distributed import TensorParallelGroup
from pagedllm.model import weight_cache
from pagedllm.model.layers import prepare_linear_weights
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.weights import GGUFWeight, LazyWeight, SafetensorsWeight, gguf_tensors
from pagedllm.paths import model_cache_enabled
from pagedllm.transformers_utils.arch import ModelArchConfig, gguf_metadata, load_arch_config
from pagedllm.transformers_utils.source import ModelSource

logger = logging.getLogger("pagedllm")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}.")
    return DTYPES[dtype]


# --- GGUF -----------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _gguf_to_hf_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if match and match.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_GGUF_LAYER_NAMES[match.group(2)]}.{suffix}"
    if base in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[base]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} is not supported by pagedllm's Llama-family loader.")


def _gguf_weights(path: Path, arch: ModelArchConfig) -> Iterator[tuple[str, LazyWeight]]:
    metadata = gguf_metadata(path)  # read once per process, and cached across runs
    names = {name for name, *_ in metadata["tensors"]}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path.name} uses per-frequency rope factors (rope_freqs), which pagedllm does not support.")
    # llama.cpp permutes q/k rows of llama-architecture checkpoints; Qwen2's are stored as-is.
    permuted = metadata["fields"].get("general.architecture") == "llama"
    for tensor in gguf_tensors(path, metadata["tensors"], metadata["byte_order"]):
        hf_name = _gguf_to_hf_name(tensor.name)
        rotary = permuted and tensor.name.endswith(("attn_q.weight", "attn_k.weight"))
        yield hf_name, GGUFWeight(tensor, rotary_head_dim=arch.head_dim if rotary else None)


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


def _load_from_source(model: LlamaForCausalLM, source: ModelSource) -> None:
    """Fill `model` from the checkpoint itself: each layer reads (and dequantizes) its slice."""
    with ExitStack() as stack:
        if source.kind == "gguf":
            weights = _gguf_weights(source.path, model.cfg)
        else:
            weights = _hf_weights(source.path, stack)
        model.load_weights(weights)


def _return_freed_memory() -> None:
    """Ask the C allocator to give freed heap pages back to the OS (glibc keeps them otherwise,
    and they count in the process's resident memory)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc
        pass


def load_model(
    source: ModelSource,
    max_position: int,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallelGroup = TensorParallelGroup(),
) -> LlamaForCausalLM:
    """Build the model for `source` and load this rank's share of its weights. A GGUF file's are
    mapped from the weight cache when it has an entry for this file and these settings, else
    read from the file and saved there (see `pagedllm.model.weight_cache`)."""
    start = time.perf_counter()
    model = LlamaForCausalLM(load_arch_config(source), max_position, backend, tp, dtype)
    use_cache = source.kind == "gguf" and model_cache_enabled()
    entry = weight_cache.entry_path(source, dtype, device, tp) if use_cache else None
    checksum = weight_cache.load(model, entry) if entry is not None else None
    from_cache = checksum is not None
    if not from_cache:
        _load_from_source(model, source)
    model = model.to(device).eval()
    prepare_linear_weights(model)  # meanwhile, the cache file's checksum runs
    if from_cache and not checksum.passed():  # the entry is gone now: build it again
        return load_model(source, max_position, backend, dtype, device, tp)
    how = "from the weight cache" if from_cache else f"from {source.path.name}"
    if not from_cache:
        if entry is not None:
            try:
                built_from = {"model": str(source.path), "dtype": str(dtype), "tp": [tp.rank, tp.size]}
                weight_cache.save(model, entry, built_from)
                how += ", saved to the weight cache"
                if device.type == "cpu":  # serve from the mapped file too: one copy, shared, pageable
                    checksum = weight_cache.load(model, entry, wait_for_checksum=True)
            except Exception as exc:  # a read-only or full disk...: the cache never fails a start
                logger.warning("Could not save the weight cache at %s: %s", entry, exc)
        _return_freed_memory()  # what building took (dequantized copies, parsers) goes back to the OS
    released = weight_cache.release_unread_pages(model) if checksum is not None else 0
    logger.info("Weights loaded %s in %.2f s%s", how, time.perf_counter() - start, f" ({entry})" if entry else "")
    logger.debug("Handed back %.2f GiB of float pages that oneDNN's packed copies replace", released / 2**30)
    return model
