"""GGUF files from tiny transformers models, written the way llama.cpp's `convert_hf_to_gguf.py`
writes each architecture: its metadata keys, gguf's own tensor name map (`gguf.TensorNameMap`,
which the converter uses), and its tensor transforms (q/k rows permuted for the llama
architecture, experts stacked per layer, Gemma's norms stored as 1 + weight, Phi-3's LongRoPE
factors as tensors). The loader maps names back with tables of its own, so the two meet only
through the file.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

# Our tiny families -> llama.cpp's architecture.
GGUF_ARCH = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "mixtral": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
    "phi3": gguf.MODEL_ARCH.PHI3,
}
# Tokenizer keys copied from a real file, so the written one has a working tokenizer.
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's two rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _checkpoint_tensors(folder: Path, family: str, num_layers: int) -> dict[str, np.ndarray]:
    """The folder's safetensors tensors (what the converter reads), each layer's experts stacked
    into one tensor per projection as the converter stacks them."""
    from safetensors.numpy import load_file

    state: dict[str, np.ndarray] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update({name: t.astype(np.float32) for name, t in load_file(str(file)).items()})
    stacks = {"mixtral": ("block_sparse_moe", ("w1", "w2", "w3")), "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
    if family in stacks:
        block, parts = stacks[family]
        for layer in range(num_layers):
            prefix = f"model.layers.{layer}.{block}.experts"
            ids = sorted({int(n[len(prefix) + 1 :].split(".")[0]) for n in state if n.startswith(prefix + ".")})
            for part in parts if ids else ():
                state[f"{prefix}.{part}.weight"] = np.stack([state.pop(f"{prefix}.{e}.{part}.weight") for e in ids])
    return state


def write_gguf(folder: Path, family: str, path: Path, tokenizer: dict | None = None,
               qtype: gguf.GGMLQuantizationType | None = None) -> Path:
    """The Hugging Face folder of a tiny `family` model as a GGUF file at `path`: float32
    tensors, or `qtype` blocks for the projections (stacked experts too) whose rows fit its blocks."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(folder))
    arch = GGUF_ARCH[family]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    num_layers = cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    writer.add_block_count(num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "head_dim", None) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if family in ("gemma2", "gemma3"):
        writer.add_sliding_window(cfg.sliding_window)
        if cfg.final_logit_softcapping is not None:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        if family == "gemma2":
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        else:
            full = rope["full_attention"]
            writer.add_rope_freq_base(full["rope_theta"])
            if full.get("rope_type") == "linear":
                writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
                writer.add_rope_scaling_factor(full["factor"])
    else:
        writer.add_rope_freq_base(rope["rope_theta"])
    if family == "mixtral":
        writer.add_rope_dimension_count(head_dim)
        writer.add_expert_count(cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    if family == "qwen3_moe":
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if family == "phi3":
        rotary = int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads
        writer.add_rope_dimension_count(rotary)
        writer.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings", cfg.original_max_position_embeddings))
        writer.add_sliding_window(cfg.sliding_window or 0)
    for key, value in (tokenizer or {}).items():
        add = {"tokenizer.ggml.model": writer.add_tokenizer_model, "tokenizer.ggml.pre": writer.add_tokenizer_pre,
               "tokenizer.ggml.tokens": writer.add_token_list, "tokenizer.ggml.token_type": writer.add_token_types,
               "tokenizer.ggml.merges": writer.add_token_merges}[key]
        add(value)
    if not tokenizer:  # the vocabulary's size is read from its token list
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([f"tok{i}" for i in range(cfg.vocab_size)])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)

    names = gguf.get_tensor_name_map(arch, num_layers)
    for name, data in _checkpoint_tensors(folder, family, num_layers).items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if family in ("llama", "mixtral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = _permute(data, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        if family in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            data = data + 1
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        quantize = qtype is not None and data.ndim >= 2 and data.shape[-1] % 32 == 0 and "norm" not in name
        if quantize:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
    if family == "phi3" and rope.get("rope_type") == "longrope":
        writer.add_rope_scaling_attn_factors(_longrope_attention_factor(cfg))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _longrope_attention_factor(cfg) -> float:
    import math

    original = cfg.rope_parameters["original_max_position_embeddings"]
    scale = cfg.max_position_embeddings / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0


def tokenizer_fields(gguf_path: Path) -> dict:
    """A real GGUF file's tokenizer metadata, to give a written file a working tokenizer."""
    reader = gguf.GGUFReader(str(gguf_path))
    return {key: reader.fields[key].contents() for key in TOKENIZER_KEYS if key in reader.fields}
