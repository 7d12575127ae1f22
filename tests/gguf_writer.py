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
    "granite": gguf.MODEL_ARCH.GRANITE,
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
               qtype: gguf.GGMLQuantizationType | None = None, float_routers: bool = False) -> Path:
    """The Hugging Face folder of a tiny `family` model as a GGUF file at `path`: float32
    tensors, or `qtype` blocks for the projections (stacked experts too) whose rows fit its blocks
    (a mixture's router too, unless `float_routers`: llama-quantize keeps them in F32)."""
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
    if family == "granite":
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    _add_tokenizer(writer, tokenizer or {})
    if not tokenizer:  # the vocabulary's size is read from its token list
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([f"tok{i}" for i in range(cfg.vocab_size)])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)

    names = gguf.get_tensor_name_map(arch, num_layers)
    for name, data in _checkpoint_tensors(folder, family, num_layers).items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if family in ("llama", "mixtral", "granite") and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = _permute(data, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        if family in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            data = data + 1
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        quantize = qtype is not None and data.ndim >= 2 and data.shape[-1] % 32 == 0 and "norm" not in name
        quantize = quantize and not (float_routers and gguf_name.startswith("blk.") and ".ffn_gate_inp" in gguf_name)
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


def _add_tokenizer(writer, tokenizer: dict) -> None:
    for key, value in tokenizer.items():
        add = {"tokenizer.ggml.model": writer.add_tokenizer_model, "tokenizer.ggml.pre": writer.add_tokenizer_pre,
               "tokenizer.ggml.tokens": writer.add_token_list, "tokenizer.ggml.token_type": writer.add_token_types,
               "tokenizer.ggml.merges": writer.add_token_merges}[key]
        add(value)


def _longrope_attention_factor(cfg) -> float:
    import math

    original = cfg.rope_parameters["original_max_position_embeddings"]
    scale = cfg.max_position_embeddings / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0


def tokenizer_fields(gguf_path: Path) -> dict:
    """A real GGUF file's tokenizer metadata, to give a written file a working tokenizer."""
    reader = gguf.GGUFReader(str(gguf_path))
    return {key: reader.fields[key].contents() for key in TOKENIZER_KEYS if key in reader.fields}


# The projections of a Llama layer as llama.cpp names them, and the top-level tensors.
LLAMA_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


# The types with a minimum (bytes 2-3 of a block, after the scale d): the minimum as a multiple
# of d that centres random values q (0..15, 0..31) about 0 (K-quants subtract it, Q4_1/Q5_1 add it).
_CENTRED_MINIMUM = {"Q4_K": 7.5, "Q5_K": 15.5, "Q4_1": -7.5, "Q5_1": -15.5, "Q2_K": 1.5}
# Byte offsets of d and of the minimum where they are not a block's first two float16 (Q2_K: after
# its scales and values). Q2_K's minimums and scales are both 0..15, its values 0..3: 1.5 centres.
_SCALE_AND_MINIMUM = {"Q2_K": (80, 82)}


def _random_tensor(name: str, rows: int, cols: int, qtype: str, generator) -> tuple[np.ndarray, object]:
    """(data, raw_dtype) of a random `rows` x `cols` weight of `qtype`: random blocks with sane
    scales for the block types (`kernels.gguf.random_weight`: no encoder needed), small normal
    values for F32/F16/BF16."""
    import torch

    from pagedllm.kernels import gguf as gguf_kernels

    if qtype in gguf_kernels.GGUF_TYPES:
        blocks = gguf_kernels.random_weight(qtype, rows, cols, generator).data.numpy().copy()
        if qtype in _CENTRED_MINIMUM:  # a row then averages about 0
            block = blocks.reshape(-1, gguf_kernels.GGUF_TYPES[qtype][1])
            d_at, min_at = _SCALE_AND_MINIMUM.get(qtype, (0, 2))
            d = block[:, d_at:d_at + 2].copy().view(np.float16).astype(np.float32)
            block[:, min_at:min_at + 2] = (d * _CENTRED_MINIMUM[qtype]).astype(np.float16).view(np.uint8)
        return blocks, gguf.GGMLQuantizationType[qtype]
    values = (torch.randn(rows, cols, generator=generator) * 0.05).numpy()
    if qtype == "F16":
        return values.astype(np.float16), None
    if qtype == "BF16":
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16), gguf.GGMLQuantizationType.BF16
    return values, None


def write_random_llama(path: Path, types: dict[str, str], hidden: int = 256, intermediate: int = 512,
                       layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 512,
                       tied: bool = True, seed: int = 0, tokenizer: dict | None = None) -> Path:
    """A llama GGUF of random weights, each tensor in the type `types` names for it (keys: the
    names in LLAMA_PROJECTIONS, "token_embd", "output"; "default" for the rest), norms in F32.
    Block types hold random blocks: the model is whatever they decode to, the same for every
    reader of the file (no weights are round-tripped through an encoder)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    if tokenizer:  # a working one (`tokenizer_fields`), for the engine; its vocabulary must be `vocab`
        _add_tokenizer(writer, tokenizer)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([f"tok{i}" for i in range(vocab)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    kind = lambda role: types.get(role, types["default"])  # noqa: E731
    head_dim = hidden // heads
    shapes = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
              "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
              "ffn_gate": (intermediate, hidden), "ffn_up": (intermediate, hidden), "ffn_down": (hidden, intermediate)}

    def add(name: str, role: str, rows: int, cols: int) -> None:
        data, raw_dtype = _random_tensor(name, rows, cols, kind(role), generator)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)

    add("token_embd.weight", "token_embd", vocab, hidden)
    for i in range(layers):
        norms = 1 + 0.1 * torch.randn(2, hidden, generator=generator).numpy()
        writer.add_tensor(f"blk.{i}.attn_norm.weight", norms[0].astype(np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norms[1].astype(np.float32))
        for role in LLAMA_PROJECTIONS:
            add(f"blk.{i}.{role}.weight", role, *shapes[role])
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    if not tied:
        add("output.weight", "output", vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
