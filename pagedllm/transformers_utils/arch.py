"""The shape of a Llama-family model, read from a Hugging Face `config.json` or GGUF metadata."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.transformers_utils.source import ModelSource

logger = logging.getLogger("pagedllm")

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# GGUF `general.architecture` -> the Hugging Face architecture it is loaded as.
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Per layer, transformers' names: "full_attention" or "sliding_attention" (the latter sees the
    # last `sliding_window` positions). None: every layer full, or every layer sliding when the
    # model has a window.
    layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"Unsupported model architecture {self.architecture!r}. "
                f"Supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"Unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types names {len(self.layer_types)} layers, but the model has {self.num_layers} "
                "(num_hidden_layers)."
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})."
            )

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window of layer `layer` (tokens each query sees, itself included), or None."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def num_parameters(self) -> int:
        """Parameters that take part in a forward pass (the tied LM head counted once)."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * (attn + mlp) + embed + head

    def valid_tensor_parallel_sizes(self) -> list[int]:
        """Sizes that split the query heads and the MLP evenly, and split or replicate the KV heads."""
        return [
            tp
            for tp in range(1, self.num_heads + 1)
            if self.num_heads % tp == 0
            and self.intermediate_size % tp == 0
            and (self.num_kv_heads % tp == 0 or tp % self.num_kv_heads == 0)
        ]

    def check_tensor_parallel_size(self, tp: int) -> None:
        valid = self.valid_tensor_parallel_sizes()
        if tp not in valid:
            raise ValueError(
                f"tensor_parallel_size={tp} cannot split this model ({self.num_heads} attention heads, "
                f"{self.num_kv_heads} KV heads, MLP width {self.intermediate_size}); valid sizes: {valid}."
            )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArchConfig":
        architectures = cfg.get("architectures") or []
        if not architectures:
            raise ValueError("config.json names no architecture (the 'architectures' field is empty).")
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"Unsupported model architecture {architecture!r}. "
                f"Supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        num_heads = cfg["num_attention_heads"]
        # Newer configs carry rope settings in `rope_parameters`; older ones in `rope_theta`
        # and `rope_scaling`.
        rope_parameters = dict(cfg.get("rope_parameters") or {})
        rope_theta = rope_parameters.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        rope_scaling = cfg.get("rope_scaling") or rope_parameters or None
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rope_scaling.setdefault("rope_type", rope_scaling.pop("type", "default"))
            if rope_scaling["rope_type"] == "default":
                rope_scaling = None
        eos = cfg.get("eos_token_id")
        sliding_window = cfg.get("sliding_window")
        layer_types = cfg.get("layer_types")
        if architecture == "Qwen2ForCausalLM":
            if not cfg.get("use_sliding_window", False):
                sliding_window = None
            elif layer_types is None:  # transformers' rule: the layers from max_window_layers on slide
                first = cfg.get("max_window_layers", 28)
                layer_types = [
                    "sliding_attention" if i >= first else "full_attention" for i in range(cfg["num_hidden_layers"])
                ]
        return cls(
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=architecture == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            rope_scaling=rope_scaling,
            sliding_window=sliding_window,
            layer_types=list(layer_types) if layer_types is not None else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        )

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any], has_output_tensor: bool) -> "ModelArchConfig":
        """Build from GGUF key/value metadata (already decoded to Python values)."""
        arch = fields.get("general.architecture")
        if arch not in _GGUF_ARCHITECTURES:
            raise ValueError(
                f"Unsupported GGUF architecture {arch!r}. Supported: {', '.join(_GGUF_ARCHITECTURES)} "
                f"(loaded as {', '.join(SUPPORTED_ARCHITECTURES)})."
            )

        def get(key: str, default: Any = None) -> Any:
            return fields.get(f"{arch}.{key}", default)

        hidden = get("embedding_length")
        num_heads = get("attention.head_count")
        tokens = fields.get("tokenizer.ggml.tokens", 0)  # the vocabulary, or its length
        vocab = get("vocab_size") or (tokens if isinstance(tokens, int) else len(tokens))
        eos = fields.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=_GGUF_ARCHITECTURES[arch],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_layers=get("block_count"),
            num_heads=num_heads,
            num_kv_heads=get("attention.head_count_kv") or num_heads,
            head_dim=get("attention.key_length") or hidden // num_heads,
            rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=get("context_length", 2048),
            tie_word_embeddings=not has_output_tensor,
            attention_bias=arch == "qwen2",
            rope_scaling=None,
            sliding_window=None,
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[eos] if eos is not None else [],
        )


# Bump when what `read_gguf_metadata` records changes: older cached metadata is then ignored.
GGUF_METADATA_VERSION = 1
_TOKENIZER_SCALARS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")


def read_gguf_fields(reader) -> dict:
    """An open `gguf.GGUFReader`'s key/value metadata as plain values, without the tokenizer's
    large arrays (the tokenizer reads those through transformers): the vocabulary as its length."""
    fields = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in _TOKENIZER_SCALARS:
            continue
        fields[key] = field.contents()
    if "tokenizer.ggml.tokens" in reader.fields:
        fields["tokenizer.ggml.tokens"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    return fields


def read_gguf_metadata(reader) -> dict:
    """What start-up needs from a GGUF file, as JSON-able data: its metadata (`read_gguf_fields`)
    and its tensor table (name, ggml type, dimensions fastest-first, byte offset in the file)."""
    return {
        "version": GGUF_METADATA_VERSION,
        "fields": read_gguf_fields(reader),
        "byte_order": reader.byte_order,
        "tensors": [
            [t.name, int(t.tensor_type), [int(n) for n in t.shape.tolist()], int(t.data_offset)] for t in reader.tensors
        ],
    }


def parse_gguf_metadata(path: Path) -> dict:
    """`read_gguf_metadata` of the file at `path`, parsed now.

    With transformers' GGUF header reader (the one its tokenizer uses) when it is there and takes
    the file: it steps over the vocabulary's strings in a fraction of a second, where gguf's
    reader builds objects for each of them (seconds on a 49k-token vocabulary). gguf's reader
    decides everything else (another transformers, a byte-swapped file, a type it lacks).
    """
    try:
        from transformers.integrations.gguf.reader import GgufHeader
        from transformers.integrations.gguf.reader import read_gguf_metadata as read_header_metadata

        values, _ = read_header_metadata(str(path))
        header = GgufHeader.from_file(str(path))
    except (ImportError, AttributeError, ValueError, KeyError, TypeError):
        import gguf

        return read_gguf_metadata(gguf.GGUFReader(str(path)))
    fields = {
        key: value for key, value in values.items() if not key.startswith("tokenizer.ggml.") or key in _TOKENIZER_SCALARS
    }
    if "tokenizer.ggml.tokens" in values:  # a string array not asked for: its length
        fields["tokenizer.ggml.tokens"] = values["tokenizer.ggml.tokens"]
    return {
        "version": GGUF_METADATA_VERSION,
        "fields": fields,
        "byte_order": "I",
        "tensors": [
            [t.name, int(t.ggml_type), [int(n) for n in reversed(t.shape)], header.data_start + t.offset]
            for t in header.tensors
        ],
    }


# Per process: file digest -> metadata, so a file's header is read at most once per process.
_gguf_metadata: dict[str, dict] = {}


def gguf_metadata(path: Path) -> dict:
    """What start-up needs from the GGUF file at `path` (`read_gguf_metadata`): from memory,
    else from the cache folder (keyed by a hash of the file's bytes), else parsed
    (`parse_gguf_metadata`) and cached."""
    from pagedllm.paths import cache_dir, model_cache_enabled
    from pagedllm.transformers_utils.file_cache import file_digest, read_json, write_json_entry

    digest = file_digest(path)
    if digest in _gguf_metadata:
        return _gguf_metadata[digest]
    enabled = model_cache_enabled()
    cached = cache_dir() / "gguf-metadata" / f"{path.stem}-{digest[:24]}.json"
    metadata = read_json(cached) if enabled else None
    if not _valid_gguf_metadata(metadata, digest):
        metadata = {**parse_gguf_metadata(path), "digest": digest}
        if enabled:
            try:
                write_json_entry(cached, metadata)
            except (OSError, TypeError, ValueError) as exc:  # the cache is only an optimisation
                logger.debug("Could not cache the GGUF metadata at %s: %s", cached, exc)
    _gguf_metadata[digest] = metadata
    return metadata


def _valid_gguf_metadata(metadata: dict | None, digest: str) -> bool:
    return (
        metadata is not None
        and metadata.get("version") == GGUF_METADATA_VERSION
        and metadata.get("digest") == digest
        and isinstance(metadata.get("fields"), dict)
        and isinstance(metadata.get("tensors"), list)
        and metadata.get("byte_order") in ("I", "S")
    )


def gguf_arch_config(metadata: dict) -> ModelArchConfig:
    """The architecture described by a GGUF file's metadata (`gguf_metadata`)."""
    names = {name for name, *_ in metadata["tensors"]}
    return ModelArchConfig.from_gguf_fields(metadata["fields"], has_output_tensor="output.weight" in names)


def load_arch_config(source: "ModelSource") -> ModelArchConfig:
    """The architecture of `source`, from its config.json or its GGUF metadata."""
    if source.kind == "hf":
        return ModelArchConfig.from_hf_config(json.loads((source.path / "config.json").read_text()))
    return gguf_arch_config(gguf_metadata(source.path))
