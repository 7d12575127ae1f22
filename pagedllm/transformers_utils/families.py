"""Every model family pagedllm serves: one `Family` entry per architecture (config.json's
`architectures[0]`), in `FAMILIES`.

An entry says how to read the family's config.json (its reader in `hf_config` and transformers'
defaults for the fields a file may leave out), which GGUF `general.architecture` names load as it
and what it reads of their metadata (its reader in `gguf_config`, its end-of-turn tokens), how
llama.cpp names its tensors, and the shapes they must have (`sizes`). The readers, the file checks
and the model classes look the entry up; nothing else is keyed by architecture name.

A new family is one model file (`pagedllm/model/<family>.py`, one line in `model/registry.py`)
plus one entry here, built from the readers and maps below where it shares them. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from pagedllm.transformers_utils import gguf_config, hf_config
from pagedllm.transformers_utils.sizes import (
    count_llama_parameters,
    count_opt_parameters,
    llama_layer_shapes,
    llama_model_shapes,
    opt_layer_shapes,
    opt_model_shapes,
    phi3_layer_shapes,
)

# llama.cpp's names of a layer's tensors (`blk.N.<name>`) -> the Hugging Face checkpoint's
# (`model.layers.N.<name>`), as llama.cpp's converter writes them for Llama-shaped families.
LLAMA_LAYER_TENSORS = {
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
QK_NORM_TENSORS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# A mixture of experts: the router and the experts' stacked projections.
EXPERT_TENSORS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Gemma's four norms a layer (ffn_norm is the one before the MLP there).
GEMMA_LAYER_TENSORS = {
    **LLAMA_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# The tensors outside the layers, named alike in every family.
GGUF_TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# transformers' Llama defaults, which most families start from.
LLAMA_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "rope_theta": 10000.0,
}
_QWEN_DEFAULTS = {**LLAMA_DEFAULTS, "vocab_size": 151936, "max_position_embeddings": 32768, "bos_token_id": None,
                  "eos_token_id": None, "sliding_window": 4096}
_QWEN_END_OF_TURN = ("<|im_end|>", "<|endoftext|>")

HFReader = Callable[..., dict[str, Any]]  # (architecture, config.json's fields, generation_config) -> fields
GGUFReader = Callable[..., dict[str, Any]]  # (get, the shared fields, tensor names, rope factors) -> fields
ShapeRule = Callable[..., dict[str, tuple[int, ...]]]
_count_gemma_parameters = partial(count_llama_parameters, norms_per_layer=4)  # its sandwich norms


@dataclass(frozen=True)
class Family:
    """What pagedllm knows of one architecture outside its model class; the defaults are
    Llama's (its GGUF tensor names, shapes and parameter count)."""

    architecture: str  # config.json's architectures[0]; the model class is registered under it
    read_hf: HFReader  # config.json -> `ModelArchConfig` fields (`hf_config`)
    hf_defaults: Mapping[str, Any]  # transformers' defaults of the fields config.json may leave out
    gguf_names: tuple[str, ...] = ()  # GGUF general.architecture values loaded as this family
    read_gguf: GGUFReader | None = None  # the fields its GGUF metadata sets beyond the shared ones
    # Token texts that end a turn, looked up in a GGUF file's vocabulary (no generation_config.json).
    end_of_turn: tuple[str, ...] = ()
    gguf_permuted_qk: bool = False  # llama.cpp interleaves each q/k head's rotary halves (its llama converter)
    # llama.cpp's layer tensor names -> ours (`model/` maps GGUF files with them, `file_checks` checks them).
    gguf_layer_tensors: Mapping[str, str] = field(default_factory=lambda: LLAMA_LAYER_TENSORS)
    layer_shapes: ShapeRule = llama_layer_shapes  # (arch, layer) -> a layer's tensor shapes, by name
    model_shapes: ShapeRule = llama_model_shapes  # (arch) -> the shapes outside the layers
    count_parameters: Callable[..., int] = count_llama_parameters  # (arch, active_only) -> parameters


_FAMILIES = (
    Family("LlamaForCausalLM", hf_config.llama, LLAMA_DEFAULTS,
           gguf_names=("llama",), read_gguf=gguf_config.llama, end_of_turn=("<|eot_id|>", "<|eom_id|>", "<|im_end|>"),
           gguf_permuted_qk=True),
    Family("MistralForCausalLM", hf_config.mistral,
           {**LLAMA_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072,
            "sliding_window": 4096},
           gguf_names=("mistral",)),
    Family("Qwen2ForCausalLM", hf_config.qwen2,
           {**_QWEN_DEFAULTS, "intermediate_size": 22016, "num_key_value_heads": 32, "max_window_layers": 28},
           gguf_names=("qwen2",), read_gguf=gguf_config.qwen2, end_of_turn=_QWEN_END_OF_TURN),
    Family("Qwen3ForCausalLM", hf_config.qwen3,
           {**_QWEN_DEFAULTS, "intermediate_size": 22016, "num_key_value_heads": 32, "head_dim": 128,
            "max_window_layers": 28},
           gguf_names=("qwen3",), read_gguf=gguf_config.qwen3, end_of_turn=_QWEN_END_OF_TURN,
           gguf_layer_tensors={**LLAMA_LAYER_TENSORS, **QK_NORM_TENSORS}),
    Family("Qwen3MoeForCausalLM", hf_config.qwen3_moe,
           {**_QWEN_DEFAULTS, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
            "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
            "norm_topk_prob": False, "decoder_sparse_step": 1},
           gguf_names=("qwen3moe",), read_gguf=gguf_config.qwen3_moe, end_of_turn=_QWEN_END_OF_TURN,
           gguf_layer_tensors={**LLAMA_LAYER_TENSORS, **QK_NORM_TENSORS, **EXPERT_TENSORS}),
    # GGUF: `llama` files with experts (gguf_config.llama).
    Family("MixtralForCausalLM", hf_config.mixtral,
           {**LLAMA_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_local_experts": 8, "num_experts_per_tok": 2},
           gguf_permuted_qk=True, gguf_layer_tensors={**LLAMA_LAYER_TENSORS, **EXPERT_TENSORS}),
    Family("Gemma2ForCausalLM", hf_config.gemma2,
           {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1, "rope_theta": 10000.0,
            "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0},
           gguf_names=("gemma2",), read_gguf=gguf_config.gemma2, end_of_turn=("<end_of_turn>",),
           gguf_layer_tensors=GEMMA_LAYER_TENSORS, count_parameters=_count_gemma_parameters),
    Family("Gemma3ForCausalLM", hf_config.gemma3,
           {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1, "rope_theta": 1e6,
            "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
            "sliding_window_pattern": 6},
           gguf_names=("gemma3",), read_gguf=gguf_config.gemma3, end_of_turn=("<end_of_turn>",),
           gguf_layer_tensors={**GEMMA_LAYER_TENSORS, **QK_NORM_TENSORS}, count_parameters=_count_gemma_parameters),
    # q/k/v and gate/up fused in the checkpoint (and in GGUF: attn_qkv, ffn_up holding both).
    Family("Phi3ForCausalLM", hf_config.phi3,
           {**LLAMA_DEFAULTS, "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
            "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "eos_token_id": 32000},
           gguf_names=("phi3",), read_gguf=gguf_config.phi3, end_of_turn=("<|end|>", "<|endoftext|>"),
           gguf_layer_tensors={**LLAMA_LAYER_TENSORS, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
           layer_shapes=phi3_layer_shapes),
    # No GGUF form (llama.cpp has no OPT converter).
    Family("OPTForCausalLM", hf_config.opt,
           {"vocab_size": 50272, "hidden_size": 768, "num_hidden_layers": 12, "ffn_dim": 3072,
            "num_attention_heads": 12, "max_position_embeddings": 2048, "do_layer_norm_before": True,
            "_remove_final_layer_norm": False, "activation_function": "relu", "bos_token_id": 2, "eos_token_id": 2,
            "enable_bias": True, "layer_norm_elementwise_affine": True, "tie_word_embeddings": True,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0},
           gguf_layer_tensors={}, layer_shapes=opt_layer_shapes, model_shapes=opt_model_shapes,
           count_parameters=count_opt_parameters),
    # Llama with multipliers (embeddings, residual branches, attention scores, logits).
    Family("GraniteForCausalLM", hf_config.granite,
           {**LLAMA_DEFAULTS, "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0,
            "logits_scaling": 1.0},
           gguf_names=("granite",), read_gguf=gguf_config.granite, gguf_permuted_qk=True),
)

FAMILIES: dict[str, Family] = {family.architecture: family for family in _FAMILIES}
# The architectures pagedllm serves, in the order errors list them.
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
# GGUF `general.architecture` -> the architecture it is loaded as (its reader may pick another:
# llama files with experts are Mixtral's, as llama.cpp writes them).
GGUF_ARCHITECTURES = {name: family.architecture for family in _FAMILIES for name in family.gguf_names}
assert len(FAMILIES) == len(_FAMILIES), "one entry per architecture"
assert len(GGUF_ARCHITECTURES) == sum(len(f.gguf_names) for f in _FAMILIES), "one family per GGUF name"
