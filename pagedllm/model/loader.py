"""Build a model with its weights loaded from a GGUF file or a Hugging Face folder (each
tensor-parallel rank reads its own slice). Finding the model and reading its architecture is
`pagedllm.transformers_utils`'s part."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch

from pagedllm.attention import AttentionBackend
from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.layers import prepare_linear_weights
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.weights import GGUFWeight, LazyWeight, SafetensorsWeight
from pagedllm.transformers_utils.arch import ModelArchConfig, gguf_arch_config, load_arch_config
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


def _gguf_arch_and_weights(path: Path) -> tuple[ModelArchConfig, Iterator[tuple[str, LazyWeight]]]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(f"{path.name} uses per-frequency rope factors (rope_freqs), which pagedllm does not support.")
    arch = gguf_arch_config(reader)
    # llama.cpp permutes q/k rows of llama-architecture checkpoints; Qwen2's are stored as-is.
    permuted = reader.fields["general.architecture"].contents() == "llama"

    def weights() -> Iterator[tuple[str, LazyWeight]]:
        for tensor in reader.tensors:
            hf_name = _gguf_to_hf_name(tensor.name)
            rotary = permuted and tensor.name.endswith(("attn_q.weight", "attn_k.weight"))
            yield hf_name, GGUFWeight(tensor, rotary_head_dim=arch.head_dim if rotary else None)

    return arch, weights()


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


def load_model(
    source: ModelSource,
    max_position: int,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallelGroup = TensorParallelGroup(),
) -> LlamaForCausalLM:
    """Build the model for `source` and load this rank's share of its weights."""
    with ExitStack() as stack:
        if source.kind == "gguf":
            arch, weights = _gguf_arch_and_weights(source.path)
        else:
            arch, weights = load_arch_config(source), _hf_weights(source.path, stack)
        model = LlamaForCausalLM(arch, max_position, backend, tp, dtype)
        model.load_weights(weights)
    model = model.to(device).eval()
    prepare_linear_weights(model)
    return model
