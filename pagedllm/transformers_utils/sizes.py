"""How large a model is: its parameter count, and the widths tensor parallelism splits. Plain
arithmetic on a `ModelArchConfig` (the counts are transformers' `num_parameters()`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.transformers_utils.arch import ModelArchConfig

# Norms per decoder layer, where not the two of a pre-norm block (Gemma's sandwich norms).
_NORMS_PER_LAYER = {"Gemma2ForCausalLM": 4, "Gemma3ForCausalLM": 4}


def count_parameters(cfg: "ModelArchConfig", active_only: bool) -> int:
    """Parameters of the model `cfg` describes (a tied head once): every stored one, or with
    `active_only` those one token uses (a mixture of experts' router and `num_experts_per_tok`
    experts)."""
    if cfg.architecture == "OPTForCausalLM":
        return _count_opt_parameters(cfg)
    h, hd = cfg.hidden_size, cfg.head_dim
    attn = h * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    attn += hd * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.attention_bias + h * cfg.attention_out_bias
    attn += 2 * hd * cfg.qk_norm
    norms = _NORMS_PER_LAYER.get(cfg.architecture, 2) * h
    dense = 3 * h * cfg.intermediate_size + (2 * cfg.intermediate_size + h) * cfg.mlp_bias
    total = 0
    for layer in range(cfg.num_layers):
        if cfg.is_moe_layer(layer):
            moe = cfg.moe
            experts = moe.num_experts_per_tok if active_only else moe.num_experts
            mlp = moe.num_experts * h + experts * 3 * h * moe.intermediate_size
        else:
            mlp = dense
        total += attn + norms + mlp
    embed = cfg.vocab_size * h
    return total + embed + h + (0 if cfg.tie_word_embeddings else embed)


def _count_opt_parameters(cfg: "ModelArchConfig") -> int:
    h, ffn = cfg.hidden_size, cfg.intermediate_size
    width = cfg.word_embed_proj_dim or h
    norm = 2 * h if cfg.layer_norm_elementwise_affine else 0
    layer = 4 * h * h + 2 * h * ffn + (4 * h + ffn + h) * cfg.attention_bias + 2 * norm
    embed = cfg.vocab_size * width + (cfg.max_position_embeddings + 2) * h
    projections = 2 * width * h if width != h else 0
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * width
    return cfg.num_layers * layer + embed + projections + head + (norm if cfg.final_layer_norm else 0)


def sharded_widths(cfg: "ModelArchConfig") -> dict[str, int]:
    """The MLP widths tensor parallelism splits, by the config field that names each."""
    widths = {}
    if cfg.moe is None or cfg.moe.dense_layers:
        widths["intermediate_size"] = cfg.intermediate_size
    if cfg.moe is not None:
        widths["moe_intermediate_size"] = cfg.moe.intermediate_size
    return widths
