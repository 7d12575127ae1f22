"""config.json -> `ModelArchConfig`, one reader per family (the table of `families` names each
family's reader and its defaults).

Each reader fills a missing (or null) field with that family's own transformers default
(`configuration_<family>.py` in transformers 5), so a config.json written by an older
transformers, which leaves defaults out, reads as transformers reads it. Rotary settings come
either as `rope_parameters` (transformers 5) or as `rope_theta` plus `rope_scaling` (older files,
`type` for `rope_type`); both are brought to one form (`_rope`), as transformers' own
`standardize_rope_params` does. A setting pagedllm does not compute is refused, naming the field.
"""

from __future__ import annotations

from typing import Any

from pagedllm.transformers_utils.arch import ModelArchConfig, MoEConfig

class _Fields:
    """config.json's value of a field, or the family's default where it is missing or null."""

    def __init__(self, cfg: dict[str, Any], defaults: dict[str, Any]) -> None:
        self.cfg, self.defaults = cfg, defaults

    def __call__(self, key: str, default: Any = None) -> Any:
        value = self.cfg.get(key)
        return value if value is not None else self.defaults.get(key, default)

    def has(self, key: str) -> bool:
        return self.cfg.get(key) is not None


def _ids(value: Any) -> list[int]:
    return [value] if isinstance(value, int) else list(value or [])


def _rope(f: _Fields, params: dict[str, Any] | None, theta: float, phi3: bool = False) -> tuple[float, dict | None, float]:
    """(rotary base, scaling or None, partial_rotary_factor) of one rope_parameters dict, as
    transformers standardises it: `type` read as `rope_type`, the base and the partial factor
    from the dict or else the top-level fields, the pretraining length filled in for the
    scalings that need it (Phi-3's top-level field first)."""
    params = dict(params or {})
    theta = float(params.pop("rope_theta", None) or theta)
    partial = float(params.pop("partial_rotary_factor", None) or f("partial_rotary_factor", 1.0))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if phi3 and rope_type in ("su", "yarn"):  # Phi-3's older names for LongRoPE
        rope_type = "longrope"
    if phi3 and rope_type not in ("default", "longrope"):
        raise ValueError(f"Phi-3 rope_scaling type {rope_type!r} is not supported; Phi-3 uses default or longrope.")
    if rope_type == "default":
        return theta, None, partial
    if rope_type in ("llama3", "yarn", "longrope"):
        if phi3 or f.has("original_max_position_embeddings"):
            params["original_max_position_embeddings"] = f("original_max_position_embeddings")
        params.setdefault("original_max_position_embeddings", f("max_position_embeddings"))
    if rope_type in ("yarn", "longrope") and params.get("factor") is None:
        params["factor"] = f("max_position_embeddings") / params["original_max_position_embeddings"]
    return theta, {"rope_type": rope_type, **params}, partial


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any] | None:
    # transformers: `rope_scaling` (older files) takes precedence over `rope_parameters`.
    return cfg.get("rope_scaling") or cfg.get("rope_parameters")


def _layer_types_from_max_window_layers(f: _Fields, window: int | None) -> list[str] | None:
    """Qwen2/Qwen3: the layers from max_window_layers on slide (when the model has a window)."""
    if f.has("layer_types"):
        return list(f("layer_types"))
    first = f("max_window_layers")
    return ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(f("num_hidden_layers"))]


def _common(arch: str, f: _Fields, generation_config: dict | None, phi3: bool = False, **overrides) -> dict[str, Any]:
    """The fields every decoder family reads the same way (`phi3`: Phi-3's rotary, the only one
    with older LongRoPE names and a partial rotary)."""
    num_heads = f("num_attention_heads")
    hidden = f("hidden_size")
    eos = _ids(f("eos_token_id"))
    for token in _ids((generation_config or {}).get("eos_token_id")):
        if token not in eos:
            eos.append(token)
    fields = dict(
        architecture=arch,
        vocab_size=f("vocab_size"),
        hidden_size=hidden,
        intermediate_size=f("intermediate_size"),
        num_layers=f("num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=f("num_key_value_heads") or num_heads,
        head_dim=f("head_dim") or hidden // num_heads,
        rms_norm_eps=float(f("rms_norm_eps")),
        max_position_embeddings=f("max_position_embeddings"),
        tie_word_embeddings=bool(f("tie_word_embeddings")),
        hidden_act=f("hidden_act", "silu"),
        bos_token_id=f("bos_token_id"),
        eos_token_ids=eos,
    )
    theta, scaling, partial = _rope(f, _rope_parameters(f.cfg), f("rope_theta"), phi3=phi3)
    fields.update(rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial)
    fields.update(overrides)
    if fields["partial_rotary_factor"] != 1.0 and not phi3:
        raise ValueError(f"partial_rotary_factor={partial} is not supported for {arch} (transformers' Phi-3 only).")
    return fields


def llama(arch, f, gen):
    # Llama: attention_bias puts biases on all four projections; mlp_bias on the MLP's.
    bias = bool(f("attention_bias", False))
    return _common(arch, f, gen, attention_bias=bias, attention_out_bias=bias, mlp_bias=bool(f("mlp_bias", False)))


def mistral(arch, f, gen):
    return _common(arch, f, gen, sliding_window=f("sliding_window"))  # no biases, whatever the config says


def qwen2(arch, f, gen):
    window = f("sliding_window") if f("use_sliding_window", False) else None
    return _common(arch, f, gen, attention_bias=True, sliding_window=window,
                   layer_types=_layer_types_from_max_window_layers(f, window))


def qwen3(arch, f, gen):
    window = f("sliding_window") if f("use_sliding_window", False) else None
    bias = bool(f("attention_bias", False))
    return _common(arch, f, gen, attention_bias=bias, attention_out_bias=bias, qk_norm=True, sliding_window=window,
                   layer_types=_layer_types_from_max_window_layers(f, window))


def qwen3_moe(arch, f, gen):
    window = f("sliding_window") if f("use_sliding_window", False) else None
    bias = bool(f("attention_bias", False))
    num_experts = f("num_local_experts") or f("num_experts")  # config.json names it either way
    num_layers, step = f("num_hidden_layers"), f("decoder_sparse_step")
    only_dense = set(f("mlp_only_layers", []) or [])
    moe = None
    if num_experts > 0:
        dense = [i for i in range(num_layers) if i in only_dense or (i + 1) % step != 0]
        moe = MoEConfig(num_experts, f("num_experts_per_tok"), f("moe_intermediate_size"), bool(f("norm_topk_prob")),
                        dense, routing_weights_in_float32=False)
    return _common(arch, f, gen, attention_bias=bias, attention_out_bias=bias, qk_norm=True, sliding_window=window,
                   moe=moe)


def mixtral(arch, f, gen):
    moe = MoEConfig(f("num_local_experts") or f("num_experts"), f("num_experts_per_tok"), f("intermediate_size"),
                    norm_topk_prob=True)
    return _common(arch, f, gen, sliding_window=f("sliding_window"), moe=moe)


def phi3(arch, f, gen):
    return _common(arch, f, gen, phi3=True, sliding_window=f("sliding_window"))


def granite(arch, f, gen):
    """Llama's fields and Granite's multipliers; its scores scale by attention_multiplier, which is
    query_pre_attn_scalar = attention_multiplier ** -2."""
    return llama(arch, f, gen) | dict(
        query_pre_attn_scalar=float(f("attention_multiplier")) ** -2, logits_scaling=float(f("logits_scaling")),
        embedding_multiplier=float(f("embedding_multiplier")), residual_multiplier=float(f("residual_multiplier")))


def _gemma_common(arch, f, gen, pattern: int, **overrides):
    if f("use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True (Gemma's encoder mode) is not supported: pagedllm "
                         "serves causal decoders.")
    layer_types = list(f("layer_types")) if f.has("layer_types") else [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(f("num_hidden_layers"))
    ]
    bias = bool(f("attention_bias", False))
    return _common(arch, f, gen, hidden_act=f("hidden_activation") or "gelu_pytorch_tanh", attention_bias=bias,
                   attention_out_bias=bias, query_pre_attn_scalar=float(f("query_pre_attn_scalar")),
                   final_logit_softcapping=f("final_logit_softcapping"), sliding_window=f("sliding_window"),
                   layer_types=layer_types, **overrides)


def gemma2(arch, f, gen):
    return _gemma_common(arch, f, gen, pattern=2, attn_logit_softcapping=f("attn_logit_softcapping"))


def gemma3(arch, f, gen):
    """Gemma 3's rotary per layer type: `rope_parameters` nested by full/sliding attention, or
    the older `rope_theta` + `rope_scaling` (full layers) and `rope_local_base_freq` (sliding).
    Its `attn_logit_softcapping` is ignored, as transformers' Gemma 3 ignores it."""
    nested = f.cfg.get("rope_parameters") or {}
    if not any(key in nested for key in ("full_attention", "sliding_attention")):
        nested = {}
    full = dict(nested.get("full_attention") or {"rope_type": "default"})
    if f.cfg.get("rope_scaling"):
        full.update(f.cfg["rope_scaling"])
    local = dict(nested.get("sliding_attention") or {"rope_type": "default"})
    theta, scaling, _ = _rope(f, full, f("rope_theta"))
    local_theta, local_scaling, _ = _rope(f, local, f("rope_local_base_freq"))
    return _gemma_common(arch, f, gen, pattern=f("sliding_window_pattern"), qk_norm=True, rope_theta=theta,
                         rope_scaling=scaling, local_rope_theta=local_theta, local_rope_scaling=local_scaling)


def opt(arch, f, gen):
    hidden, bias = f("hidden_size"), bool(f("enable_bias"))
    return _common(
        arch, f, gen, intermediate_size=f("ffn_dim"), num_kv_heads=f("num_attention_heads"),
        head_dim=hidden // f("num_attention_heads"), rms_norm_eps=1e-5, hidden_act=f("activation_function"),
        attention_bias=bias, attention_out_bias=bias, mlp_bias=bias, rope_scaling=None,
        word_embed_proj_dim=f("word_embed_proj_dim") or hidden, do_layer_norm_before=bool(f("do_layer_norm_before")),
        layer_norm_elementwise_affine=bool(f("layer_norm_elementwise_affine")),
        final_layer_norm=bool(f("do_layer_norm_before")) and not f("_remove_final_layer_norm"),
    )


def arch_config_from_hf(cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelArchConfig:
    architectures = cfg.get("architectures") or []
    if not architectures:
        raise ValueError("config.json names no architecture (the 'architectures' field is empty).")
    from pagedllm.transformers_utils.families import FAMILIES, SUPPORTED_ARCHITECTURES  # (it imports the readers)

    architecture = architectures[0]
    if architecture not in FAMILIES:
        raise ValueError(
            f"Unsupported model architecture {architecture!r}. "
            f"Supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise ValueError(
            f"config.json has a quantization_config ({method}): pagedllm reads plain float safetensors weights, "
            "not pre-quantized checkpoints. Use the unquantized model or a GGUF file."
        )
    family = FAMILIES[architecture]
    return ModelArchConfig(**family.read_hf(architecture, _Fields(cfg, family.hf_defaults), generation_config))
