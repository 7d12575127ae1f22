"""GGUF metadata -> `ModelArchConfig`, with the keys and conventions llama.cpp's
`convert_hf_to_gguf.py` writes and its loader reads (`<arch>.<key>`): the fields every family
shares here, and one reader per family for its own (the table of `families` names, per family,
its `general.architecture` names, its reader and its end-of-turn tokens).

Where a GGUF file carries no value that config.json would (Gemma's query scale, its sliding
pattern, Gemma 3's local rotary base), the value llama.cpp itself assumes is used, so a file runs
here as it runs there. Torch-free.
"""

from __future__ import annotations

from typing import Any

from pagedllm.transformers_utils.arch import ModelArchConfig, MoEConfig

def arch_config_from_gguf(fields: dict[str, Any], tensor_names: set[str], rope_factors: dict[str, list[float]]) -> ModelArchConfig:
    from pagedllm.transformers_utils.families import GGUF_ARCHITECTURES, FAMILIES  # (it imports the readers)

    arch = fields.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r}. Supported: {', '.join(GGUF_ARCHITECTURES)} "
            f"(loaded as {', '.join(dict.fromkeys(GGUF_ARCHITECTURES.values()))}; Mixtral files are llama)."
        )
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("this GGUF file uses per-frequency rope factors (rope_freqs: Llama 3.1's scaling), "
                         "which pagedllm does not read from GGUF; use the Hugging Face folder.")

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{key}")
        return default if value is None else value

    hidden = get("embedding_length")
    num_heads = get("attention.head_count")
    if isinstance(num_heads, list) or isinstance(get("attention.head_count_kv"), list):
        raise ValueError("this GGUF file has a different number of heads per layer, which pagedllm does not support.")
    num_layers = get("block_count")
    head_dim = get("attention.key_length") or hidden // num_heads
    tokens = fields.get("tokenizer.ggml.tokens", 0)  # the vocabulary, or its length
    eos = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = fields.get(f"tokenizer.ggml.{key}")
        if token is not None and token not in eos:
            eos.append(token)
    family = FAMILIES[GGUF_ARCHITECTURES[arch]]
    cfg: dict[str, Any] = dict(
        architecture=family.architecture,
        vocab_size=get("vocab_size") or (tokens if isinstance(tokens, int) else len(tokens)),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=get("attention.head_count_kv") or num_heads,
        head_dim=head_dim,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(get),
        max_position_embeddings=get("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos,
        end_of_turn_tokens=list(family.end_of_turn),
    )
    if family.read_gguf is not None:
        cfg.update(family.read_gguf(get, cfg, tensor_names, rope_factors))
    return ModelArchConfig(**cfg)


# --- each family's own fields: (get, the shared fields, tensor names, rope factors) -> fields ---


def llama(get, cfg, tensor_names, rope_factors) -> dict[str, Any]:
    """llama.cpp writes Mixtral as `llama` with experts."""
    if get("expert_count", 0) > 0:
        return dict(architecture="MixtralForCausalLM",
                    moe=_moe(get, cfg["num_layers"], tensor_names, norm=True, float32=True))
    return {}


def qwen2(get, cfg, tensor_names, rope_factors) -> dict[str, Any]:
    return dict(attention_bias=True)


def qwen3(get, cfg, tensor_names, rope_factors) -> dict[str, Any]:
    return dict(qk_norm=True)


def qwen3_moe(get, cfg, tensor_names, rope_factors) -> dict[str, Any]:
    # llama.cpp's Qwen3-MoE always renormalises the chosen experts' weights.
    return dict(qk_norm=True, moe=_moe(get, cfg["num_layers"], tensor_names, norm=True, float32=False))


def granite(get, cfg, tensor_names, rope_factors) -> dict[str, Any]:
    """Granite's multipliers, under llama.cpp's names (scores scale by attention.scale)."""
    return dict(query_pre_attn_scalar=float(get("attention.scale", cfg["head_dim"] ** -0.5)) ** -2,
                embedding_multiplier=float(get("embedding_scale", 1.0)),
                residual_multiplier=float(get("residual_scale", 1.0)), logits_scaling=float(get("logit_scale", 1.0)))


def _rope_scaling(get) -> dict[str, Any] | None:
    kind = get("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": float(get("rope.scaling.factor")),
                "original_max_position_embeddings": get("rope.scaling.original_context_length")}
    raise ValueError(f"Unsupported GGUF rope scaling type {kind!r} (rope.scaling.type); supported: none, linear, yarn.")


def _moe(get, num_layers: int, tensor_names: set[str], norm: bool, float32: bool) -> MoEConfig:
    # A layer without a router is dense (the file says which, tensor by tensor).
    dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    return MoEConfig(get("expert_count"), get("expert_used_count"),
                     get("expert_feed_forward_length") or get("feed_forward_length"), norm, dense, float32)


def _gemma(get, cfg, pattern: int, layers_27b: int) -> dict[str, Any]:
    """Gemma's layer pattern (llama.cpp's default: layer i slides unless (i + 1) is a multiple of
    `pattern`) and query scale: the 27B models (`layers_27b` layers; GGUF has no
    query_pre_attn_scalar) scale queries by (hidden / heads) ** -0.5, the others by head_dim ** -0.5."""
    pattern = get("attention.sliding_window_pattern", pattern)
    num_layers, hidden, num_heads = cfg["num_layers"], cfg["hidden_size"], cfg["num_heads"]
    return dict(
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=float(hidden // num_heads if num_layers == layers_27b else cfg["head_dim"]),
        final_logit_softcapping=get("final_logit_softcapping"),
        sliding_window=get("attention.sliding_window") or None,
        layer_types=["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)],
    )


def gemma2(get, cfg, tensor_names, rope_factors) -> dict[str, Any]:
    return _gemma(get, cfg, pattern=2, layers_27b=46) | dict(attn_logit_softcapping=get("attn_logit_softcapping"))


def gemma3(get, cfg, tensor_names, rope_factors) -> dict[str, Any]:
    # llama.cpp's Gemma 3 sliding layers turn at base 10000, unscaled.
    return _gemma(get, cfg, pattern=6, layers_27b=62) | dict(
        qk_norm=True, local_rope_theta=float(get("rope.freq_base_swa", 10000.0)), local_rope_scaling=None)


def phi3(get, cfg, tensor_names, rope_factors) -> dict[str, Any]:
    head_dim = cfg["head_dim"]
    rotary_dims = get("rope.dimension_count", head_dim)
    fields: dict[str, Any] = dict(partial_rotary_factor=rotary_dims / head_dim, sliding_window=get("attention.sliding_window") or None)
    if "rope_factors_long.weight" in rope_factors:
        original = get("rope.scaling.original_context_length", get("context_length"))
        fields["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": rope_factors["rope_factors_long.weight"],
            "short_factor": rope_factors["rope_factors_short.weight"],
            "original_max_position_embeddings": original,
            "factor": get("context_length") / original,
            "attention_factor": get("rope.scaling.attn_factor"),
        }
    return fields
