"""How large a model is: its parameter count, the widths tensor parallelism splits, and the
shape of each tensor its checkpoint holds. Plain arithmetic on a `ModelArchConfig` (the counts
are transformers' `num_parameters()`; the shapes, torch's order, are what `file_checks` checks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.transformers_utils.arch import ModelArchConfig


def count_llama_parameters(cfg: "ModelArchConfig", active_only: bool, norms_per_layer: int = 2) -> int:
    """Parameters of the Llama-shaped model `cfg` describes (a tied head once): every stored one,
    or with `active_only` those one token uses (a mixture of experts' router and
    `num_experts_per_tok` experts). `norms_per_layer`: 4 for Gemma's sandwich norms."""
    h, hd = cfg.hidden_size, cfg.head_dim
    attn = h * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    attn += hd * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.attention_bias + h * cfg.attention_out_bias
    attn += 2 * hd * cfg.qk_norm
    norms = norms_per_layer * h
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


def count_opt_parameters(cfg: "ModelArchConfig", active_only: bool) -> int:
    """OPT's parameters: biases and LayerNorms, learned positions, a narrower embedding's
    projections (no experts: `active_only` changes nothing)."""
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


# --- expected tensor shapes (each family names its functions in `families`) -------------------


def _attention_shapes(arch: "ModelArchConfig") -> dict[str, tuple[int, ...]]:
    """A layer's attention projections, biases, q/k norms and norms, under Llama's names."""
    hidden, head = arch.hidden_size, arch.head_dim
    q, kv = arch.num_heads * head, arch.num_kv_heads * head
    shapes: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, q),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.bias": (hidden,), "self_attn.q_norm.weight": (head,), "self_attn.k_norm.weight": (head,),
    }
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
        shapes[f"{norm}.weight"] = (hidden,)
    return shapes


def llama_layer_shapes(arch: "ModelArchConfig", layer: int) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama-shaped layer may hold (the names of `file_checks._hf_name`) -> its
    shape: a dense gated MLP, or a mixture of experts (stacked as GGUF and transformers 5 store
    them, or one tensor per expert)."""
    hidden, width = arch.hidden_size, arch.intermediate_size
    shapes = _attention_shapes(arch)
    if arch.moe is not None and arch.moe.is_sparse(layer):
        experts, expert_width = arch.moe.num_experts, arch.moe.intermediate_size
        return shapes | {
            "mlp.gate.weight": (experts, hidden),
            "mlp.experts.gate_proj.weight": (experts, expert_width, hidden),  # GGUF: every expert stacked
            "mlp.experts.up_proj.weight": (experts, expert_width, hidden),
            "mlp.experts.down_proj.weight": (experts, hidden, expert_width),
            "mlp.experts.gate_up_proj": (experts, 2 * expert_width, hidden),  # transformers 5: fused, stacked
            "mlp.experts.down_proj": (experts, hidden, expert_width),
            "mlp.experts.*.gate_proj.weight": (expert_width, hidden),
            "mlp.experts.*.up_proj.weight": (expert_width, hidden),
            "mlp.experts.*.down_proj.weight": (hidden, expert_width),
        }
    return shapes | {"mlp.gate_proj.weight": (width, hidden), "mlp.up_proj.weight": (width, hidden),
                     "mlp.down_proj.weight": (hidden, width), "mlp.gate_proj.bias": (width,),
                     "mlp.up_proj.bias": (width,), "mlp.down_proj.bias": (hidden,)}


def phi3_layer_shapes(arch: "ModelArchConfig", layer: int) -> dict[str, tuple[int, ...]]:
    """Phi-3: q, k and v fused; gate and up fused."""
    hidden, width = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return _attention_shapes(arch) | {"self_attn.qkv_proj.weight": (q + 2 * kv, hidden),
                                      "mlp.gate_up_proj.weight": (2 * width, hidden),
                                      "mlp.down_proj.weight": (hidden, width)}


def opt_layer_shapes(arch: "ModelArchConfig", layer: int) -> dict[str, tuple[int, ...]]:
    """OPT: its own names; biases and LayerNorms everywhere."""
    hidden, width = arch.hidden_size, arch.intermediate_size
    shapes = _attention_shapes(arch) | {
        "self_attn.out_proj.weight": (hidden, arch.num_heads * arch.head_dim), "self_attn.out_proj.bias": (hidden,),
        "fc1.weight": (width, hidden), "fc1.bias": (width,), "fc2.weight": (hidden, width), "fc2.bias": (hidden,),
    }
    for norm in ("self_attn_layer_norm", "final_layer_norm"):
        shapes |= {f"{norm}.weight": (hidden,), f"{norm}.bias": (hidden,)}
    return shapes


def llama_model_shapes(arch: "ModelArchConfig") -> dict[str, tuple[int, ...]]:
    """The tensors outside the layers with a fixed shape (the embedding and lm_head apart)."""
    hidden = arch.hidden_size
    return {"model.norm.weight": (hidden,), "model.final_layer_norm.weight": (hidden,),
            "model.final_layer_norm.bias": (hidden,)}


def opt_model_shapes(arch: "ModelArchConfig") -> dict[str, tuple[int, ...]]:
    """OPT's also: learned positions (2 rows of offset), and the projections in and out of a
    narrower embedding."""
    hidden, width = arch.hidden_size, arch.word_embed_proj_dim or arch.hidden_size
    return llama_model_shapes(arch) | {"model.embed_positions.weight": (arch.max_position_embeddings + 2, hidden),
                                 "model.project_in.weight": (hidden, width), "model.project_out.weight": (width, hidden)}
