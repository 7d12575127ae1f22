"""The shape of a model, read from a Hugging Face `config.json` or GGUF metadata, as plain data.

`ModelArchConfig` is one dataclass for every family: the fields all decoders share, and each
family's own (Gemma's soft-caps and query scale, Qwen3's q/k norms, a mixture of experts, OPT's
projections and norm placement), left at their neutral defaults by the families without them.
The readers that fill it live beside it, one function per family: `hf_config` (config.json) and
`gguf_config` (GGUF metadata, as llama.cpp writes it); `families` names each family's readers,
defaults, tensor names and shapes. Torch-free, like the rest of `transformers_utils`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.transformers_utils.sizes import sharded_widths

if TYPE_CHECKING:
    from pagedllm.transformers_utils.families import Family
    from pagedllm.transformers_utils.source import ModelSource

logger = logging.getLogger("pagedllm")

# Rotary scalings computed (transformers' names); "dynamic" rescales with the sequence length,
# which a cache of rotated keys cannot follow, so it is refused with the others.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# Activations of the MLPs (transformers' ACT2FN names).
SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu")


@dataclass
class MoEConfig:
    """A sparse mixture-of-experts MLP: each token runs `num_experts_per_tok` of `num_experts`
    gated MLPs, picked by a softmax router, and sums their outputs weighted by the router."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # each expert's MLP width
    norm_topk_prob: bool  # rescale the chosen experts' probabilities to sum to 1
    # Layers whose MLP is dense (`intermediate_size` of the model) instead: Qwen3-MoE's
    # mlp_only_layers and decoder_sparse_step.
    dense_layers: list[int] = field(default_factory=list)
    # Mixtral weighs expert outputs by float32 probabilities; Qwen3-MoE rounds them to the model's
    # dtype first (each as transformers does).
    routing_weights_in_float32: bool = True

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's width (OPT: ffn_dim)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float  # every norm's epsilon (OPT: its LayerNorms')
    rope_theta: float  # the rotary base (of full-attention layers, where local ones differ)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # biases on the q, k and v projections
    # transformers' rope_parameters without rope_theta: rope_type and its fields (factor, ...);
    # None: plain rotary.
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    # Ids that end generation: config.json's eos_token_id and generation_config.json's (GGUF:
    # the tokenizer's EOS, end-of-turn and end-of-message ids).
    eos_token_ids: list[int] = field(default_factory=list)
    # Per layer, transformers' names: "full_attention" or "sliding_attention" (the latter sees the
    # last `sliding_window` positions). None: every layer full, or every layer sliding when the
    # model has a window.
    layer_types: list[str] | None = None
    attention_out_bias: bool = False  # a bias on the attention's output projection
    mlp_bias: bool = False
    hidden_act: str = "silu"
    qk_norm: bool = False  # RMSNorm over each query and key head before the rotary (Qwen3, Gemma 3)
    # Attention scores scale by query_pre_attn_scalar ** -0.5 (Gemma), else by head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None  # scores -> c * tanh(scores / c) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> c * tanh(logits / c) (Gemma 2 and 3)
    # The rotary of sliding-window layers, where it differs from the full layers' (Gemma 3).
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0  # the fraction of each head the rotary turns (Phi-4-mini)
    moe: MoEConfig | None = None
    # OPT: the embedding width when it differs from hidden_size (project_in/out), where the
    # LayerNorms sit, whether they have weights, and whether the final one exists.
    word_embed_proj_dim: int | None = None
    do_layer_norm_before: bool = True
    layer_norm_elementwise_affine: bool = True
    final_layer_norm: bool = True
    # Granite: the embeddings scale by embedding_multiplier, each attention and MLP output by
    # residual_multiplier before its residual add; the logits are divided by logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Token texts that end a turn, looked up in the tokenizer's vocabulary (GGUF files, which
    # carry no generation_config.json; llama.cpp finds them the same way).
    end_of_turn_tokens: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        from pagedllm.transformers_utils.families import SUPPORTED_ARCHITECTURES  # (its readers import this module)

        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"Unsupported model architecture {self.architecture!r}. "
                f"Supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        for name, scaling in (("rope_scaling", self.rope_scaling), ("local rope_scaling", self.local_rope_scaling)):
            rope_type = (scaling or {}).get("rope_type", "default")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"Unsupported {name} type {rope_type!r} (rope_scaling.rope_type); supported: "
                    f"{', '.join(SUPPORTED_ROPE_TYPES)}."
                )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"Unsupported activation {self.hidden_act!r} (hidden_act); supported: {', '.join(SUPPORTED_ACTIVATIONS)}."
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types names {len(self.layer_types)} layers, but the model has {self.num_layers} "
                    "(num_hidden_layers)."
                )
            unknown = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
            if unknown:
                raise ValueError(f"Unsupported layer_types {unknown}; supported: full_attention, sliding_attention.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})."
            )
        if not 0 < self.partial_rotary_factor <= 1 or int(self.head_dim * self.partial_rotary_factor) % 2:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} must turn an even number of each head's "
                f"{self.head_dim} dimensions."
            )
        moe = self.moe
        if moe is not None and not 0 < moe.num_experts_per_tok <= moe.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({moe.num_experts_per_tok}) must be between 1 and the number of experts "
                f"({moe.num_experts})."
            )

    @property
    def family(self) -> "Family":
        """The architecture's entry in `families` (its readers, tensor names and shapes)."""
        from pagedllm.transformers_utils.families import FAMILIES

        return FAMILIES[self.architecture]

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window of layer `layer` (tokens each query sees, itself included), or None."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def layer_rope(self, layer: int) -> tuple[float, dict[str, Any] | None]:
        """(rotary base, scaling) of layer `layer`: the local ones on Gemma 3's sliding layers."""
        local = self.layer_types is not None and self.layer_types[layer] == "sliding_attention"
        if local and self.local_rope_theta is not None:
            return self.local_rope_theta, self.local_rope_scaling
        return self.rope_theta, self.rope_scaling

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.is_sparse(layer)

    # --- sizes -------------------------------------------------------------------------------

    @property
    def num_parameters(self) -> int:
        """Parameters that take part in one token's forward pass (a tied LM head counted once):
        of a mixture of experts, the router and the `num_experts_per_tok` experts each token
        runs. `num_total_parameters` counts every stored one."""
        return self.family.count_parameters(self, active_only=True)

    @property
    def num_total_parameters(self) -> int:
        """Every parameter the model stores (a tied LM head once), all experts included: what
        transformers' `num_parameters()` counts."""
        return self.family.count_parameters(self, active_only=False)

    def valid_tensor_parallel_sizes(self) -> list[int]:
        """Sizes that split the query heads and the MLPs (each expert's too) evenly, and split or
        replicate the KV heads."""
        return [
            tp
            for tp in range(1, self.num_heads + 1)
            if self.num_heads % tp == 0
            and all(width % tp == 0 for width in sharded_widths(self).values())
            and (self.num_kv_heads % tp == 0 or tp % self.num_kv_heads == 0)
        ]

    def check_tensor_parallel_size(self, tp: int) -> None:
        valid = self.valid_tensor_parallel_sizes()
        if tp not in valid:
            widths = ", ".join(f"{name} {width}" for name, width in sharded_widths(self).items())
            raise ValueError(
                f"tensor_parallel_size={tp} cannot split this model ({self.num_heads} attention heads, "
                f"{self.num_kv_heads} KV heads, {widths}); valid sizes: {valid}."
            )

    # --- readers -----------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> "ModelArchConfig":
        """From a config.json (and the model's generation_config.json, for its stop tokens)."""
        from pagedllm.transformers_utils.hf_config import arch_config_from_hf

        return arch_config_from_hf(cfg, generation_config)

    @classmethod
    def from_gguf_fields(
        cls, fields: dict[str, Any], has_output_tensor: bool, tensor_names: set[str] | None = None,
        rope_factors: dict[str, list[float]] | None = None,
    ) -> "ModelArchConfig":
        """From GGUF key/value metadata (already decoded to Python values), the names of the file's
        tensors, and the values of its rope factor tensors (Phi-3's LongRoPE)."""
        from pagedllm.transformers_utils.gguf_config import arch_config_from_gguf

        names = set(tensor_names or ()) | ({"output.weight"} if has_output_tensor else set())
        return arch_config_from_gguf(fields, names, rope_factors or {})


# Bump when what `read_gguf_metadata` records changes: older cached metadata is then ignored.
GGUF_METADATA_VERSION = 2
_TOKENIZER_SCALARS = (
    "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)
# Small tensors the architecture reads (LongRoPE's per-frequency factors, Phi-3).
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


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
        "rope_factors": {
            t.name: [float(x) for x in t.data.reshape(-1)] for t in reader.tensors if t.name in ROPE_FACTOR_TENSORS
        },
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
    tensors = [
        [t.name, int(t.ggml_type), [int(n) for n in reversed(t.shape)], header.data_start + t.offset]
        for t in header.tensors
    ]
    return {
        "version": GGUF_METADATA_VERSION,
        "fields": fields,
        "byte_order": "I",
        "tensors": tensors,
        "rope_factors": _read_rope_factors(path, tensors),
    }


def _read_rope_factors(path: Path, tensors: list) -> dict[str, list[float]]:
    """The values of the file's rope factor tensors (a few dozen float32 each), which the
    architecture needs before any weight is read."""
    import array

    factors = {}
    with open(path, "rb") as f:
        for name, type_id, dims, offset in tensors:
            if name in ROPE_FACTOR_TENSORS:
                if type_id != 0:  # GGML_TYPE_F32, as llama.cpp writes them
                    raise ValueError(f"{path.name}: {name} is not float32 (ggml type {type_id})")
                count = 1
                for n in dims:
                    count *= n
                f.seek(offset)
                values = array.array("f")
                values.frombytes(f.read(4 * count))
                factors[name] = [float(x) for x in values]
    return factors


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
        and isinstance(metadata.get("rope_factors"), dict)
    )


def gguf_arch_config(metadata: dict) -> ModelArchConfig:
    """The architecture described by a GGUF file's metadata (`gguf_metadata`)."""
    names = {name for name, *_ in metadata["tensors"]}
    return ModelArchConfig.from_gguf_fields(
        metadata["fields"], "output.weight" in names, names, metadata.get("rope_factors", {})
    )


# Model files already checked in this process: (path, size, mtime) -> what the checks read.
_checked_sources: dict[tuple[str, int, int], object] = {}


def load_arch_config(source: "ModelSource") -> ModelArchConfig:
    """The architecture of `source`, from its config.json or its GGUF metadata, once its files
    passed the checks of `file_checks` (a `ValueError` naming the file and what is wrong)."""
    from pagedllm.transformers_utils.file_checks import check_model_files, check_tensor_shapes

    stat = source.path.stat()
    key = (str(source.path), stat.st_size, stat.st_mtime_ns)
    checked = _checked_sources.get(key) or check_model_files(source)
    if source.kind == "hf":
        generation = source.path / "generation_config.json"
        try:
            generation_config = json.loads(generation.read_text()) if generation.is_file() else None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"The model's {generation} is not valid JSON: {exc}.") from None
        arch = ModelArchConfig.from_hf_config(json.loads((source.path / "config.json").read_text()), generation_config)
    else:
        arch = gguf_arch_config(gguf_metadata(source.path))
    check_tensor_shapes(checked, arch)
    _checked_sources[key] = checked
    return arch
