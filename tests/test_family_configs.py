"""config.json as the families' real checkpoints write it (shrunk, the keys and conventions
kept: legacy rope_theta/rope_scaling, rope_local_base_freq, sliding_window_pattern without
layer_types, head_dim left out, num_experts or num_local_experts, Phi-3's longrope "type"),
read by pagedllm and by transformers' own AutoConfig (the oracle) to the same architecture; and
the settings pagedllm does not compute refused with the field named."""

from __future__ import annotations

import json

import pytest

from pagedllm.transformers_utils.arch import ModelArchConfig
from pagedllm.transformers_utils.hf_config import arch_config_from_hf

_PHI_FACTORS = {"long_factor": [1.0 + 0.25 * i for i in range(8)], "short_factor": [1.0 + 0.01 * i for i in range(8)]}

REAL_CONFIGS = {
    "qwen3-0.6b": {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
                   "eos_token_id": 151645, "head_dim": 32, "hidden_act": "silu", "hidden_size": 64,
                   "intermediate_size": 96, "max_position_embeddings": 40960, "max_window_layers": 28,
                   "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 3, "num_key_value_heads": 2,
                   "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
                   "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False,
                   "vocab_size": 1000},
    "qwen3-no-head-dim-yarn": {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
                               "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 2,
                               "num_key_value_heads": 2, "vocab_size": 1000, "rope_theta": 1000000,
                               "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 32768}},
    "qwen3-30b-a3b": {"architectures": ["Qwen3MoeForCausalLM"], "bos_token_id": 151643, "decoder_sparse_step": 1,
                      "eos_token_id": 151645, "head_dim": 32, "hidden_size": 64, "intermediate_size": 96,
                      "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
                      "model_type": "qwen3_moe", "moe_intermediate_size": 24, "norm_topk_prob": True,
                      "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 3,
                      "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
                      "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False,
                      "vocab_size": 1000},
    "qwen3-moe-sparse-step": {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "model_type": "qwen3_moe",
                              "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2,
                              "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 2, "mlp_only_layers": [3],
                              "vocab_size": 1000},
    "mixtral-8x7b": {"architectures": ["MixtralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
                     "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 32768,
                     "model_type": "mixtral", "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
                     "num_key_value_heads": 2, "num_local_experts": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
                     "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
                     "vocab_size": 1000},
    "gemma-2-2b": {"architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0, "bos_token_id": 2,
                   "cache_implementation": "hybrid", "eos_token_id": [1, 107], "final_logit_softcapping": 30.0,
                   "head_dim": 32, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
                   "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 8192, "model_type": "gemma2",
                   "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2, "pad_token_id": 0,
                   "query_pre_attn_scalar": 32, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
                   "vocab_size": 1000},
    "gemma-3-1b": {"architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": None, "bos_token_id": 2,
                   "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 32,
                   "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 64, "intermediate_size": 96,
                   "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
                   "num_hidden_layers": 7, "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 32,
                   "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
                   "sliding_window": 512, "sliding_window_pattern": 6, "vocab_size": 1000},
    "gemma-3-4b-text": {"architectures": ["Gemma3ForCausalLM"], "head_dim": 32, "hidden_size": 64,
                        "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 6,
                        "num_key_value_heads": 2, "query_pre_attn_scalar": 32, "rope_local_base_freq": 10000.0,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "rope_theta": 1000000.0,
                        "sliding_window": 1024, "vocab_size": 1000},
    "phi-3-mini-4k": {"architectures": ["Phi3ForCausalLM"], "bos_token_id": 1, "eos_token_id": 32000,
                      "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 4096,
                      "model_type": "phi3", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4,
                      "original_max_position_embeddings": 4096, "pad_token_id": 32000, "rms_norm_eps": 1e-05,
                      "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False,
                      "vocab_size": 1000},
    "phi-3.5-mini": {"architectures": ["Phi3ForCausalLM"], "hidden_size": 64, "max_position_embeddings": 131072,
                     "model_type": "phi3", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4,
                     "original_max_position_embeddings": 4096, "rope_scaling": {**_PHI_FACTORS, "type": "longrope"},
                     "sliding_window": 262144, "vocab_size": 1000},
    "phi-4-mini": {"architectures": ["Phi3ForCausalLM"], "hidden_size": 96, "intermediate_size": 128,
                   "max_position_embeddings": 131072, "model_type": "phi3", "num_attention_heads": 3,
                   "num_hidden_layers": 2, "num_key_value_heads": 1, "original_max_position_embeddings": 4096,
                   "partial_rotary_factor": 0.5, "rope_scaling": {**_PHI_FACTORS, "type": "longrope"},
                   "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True, "vocab_size": 1000},
    "phi-3-su": {"architectures": ["Phi3ForCausalLM"], "hidden_size": 64, "max_position_embeddings": 131072,
                 "model_type": "phi3", "num_attention_heads": 4, "num_hidden_layers": 2,
                 "rope_scaling": {**_PHI_FACTORS, "type": "su", "original_max_position_embeddings": 4096},
                 "vocab_size": 1000},
    "opt-125m": {"_remove_final_layer_norm": False, "activation_function": "relu", "architectures": ["OPTForCausalLM"],
                 "bos_token_id": 2, "do_layer_norm_before": True, "eos_token_id": 2, "ffn_dim": 96, "hidden_size": 64,
                 "max_position_embeddings": 2048, "model_type": "opt", "num_attention_heads": 4,
                 "num_hidden_layers": 2, "pad_token_id": 1, "prefix": "</s>", "vocab_size": 1000,
                 "word_embed_proj_dim": 64},
    "opt-350m": {"activation_function": "relu", "architectures": ["OPTForCausalLM"], "do_layer_norm_before": False,
                 "ffn_dim": 128, "hidden_size": 64, "model_type": "opt", "num_attention_heads": 4,
                 "num_hidden_layers": 2, "vocab_size": 1000, "word_embed_proj_dim": 32},
}


def _transformers_config(cfg: dict, tmp_path):
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return AutoConfig.from_pretrained(str(tmp_path))


def _ids(value) -> list[int]:
    return [value] if isinstance(value, int) else list(value or [])


def _their_rope(tc, layer: int) -> dict:
    params = tc.rope_parameters
    if "full_attention" in params or "sliding_attention" in params:  # nested by layer type (Gemma 3)
        params = params[tc.layer_types[layer]]
    return dict(params)


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_config_reads_as_transformers_reads_it(name, tmp_path):
    cfg = REAL_CONFIGS[name]
    ours = arch_config_from_hf(cfg)
    tc = _transformers_config(cfg, tmp_path)
    opt = ours.architecture == "OPTForCausalLM"
    assert ours.head_dim == (getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads)
    assert ours.num_kv_heads == (tc.num_attention_heads if opt else tc.num_key_value_heads)
    assert ours.eos_token_ids == _ids(tc.eos_token_id) and ours.bos_token_id == tc.bos_token_id
    assert ours.tie_word_embeddings == tc.tie_word_embeddings
    assert ours.max_position_embeddings == tc.max_position_embeddings
    for layer in range(ours.num_layers):
        layer_types = getattr(tc, "layer_types", None)
        slides = layer_types is None or layer_types[layer] == "sliding_attention"
        window = getattr(tc, "sliding_window", None)
        assert ours.layer_sliding_window(layer) == (window if slides else None), layer
        if opt:
            continue
        theirs = _their_rope(tc, layer)
        theta, scaling = ours.layer_rope(layer)
        assert theta == theirs.pop("rope_theta"), layer
        assert ours.partial_rotary_factor == theirs.pop("partial_rotary_factor", 1.0)
        if theirs.get("rope_type", "default") == "default":
            assert scaling is None
        else:
            for key, value in theirs.items():
                assert scaling.get(key, value) == value, (layer, key)
            assert scaling["rope_type"] == theirs["rope_type"]
    if ours.architecture.startswith("Gemma"):
        assert ours.query_pre_attn_scalar == tc.query_pre_attn_scalar
        assert ours.final_logit_softcapping == tc.final_logit_softcapping
        # Gemma 3's attention is never soft-capped in transformers, whatever the config says.
        expected_cap = tc.attn_logit_softcapping if ours.architecture == "Gemma2ForCausalLM" else None
        assert ours.attn_logit_softcapping == expected_cap
    if ours.moe is not None:
        moe = ours.moe
        assert moe.num_experts == tc.num_local_experts and moe.num_experts_per_tok == tc.num_experts_per_tok
        if ours.architecture == "Qwen3MoeForCausalLM":
            assert moe.intermediate_size == tc.moe_intermediate_size and moe.norm_topk_prob == tc.norm_topk_prob
            sparse = [i not in tc.mlp_only_layers and (i + 1) % tc.decoder_sparse_step == 0 for i in range(ours.num_layers)]
            assert [moe.is_sparse(i) for i in range(ours.num_layers)] == sparse
    if opt:
        assert ours.word_embed_proj_dim == tc.word_embed_proj_dim
        assert ours.do_layer_norm_before == tc.do_layer_norm_before
        assert ours.final_layer_norm == (tc.do_layer_norm_before and not tc._remove_final_layer_norm)


def test_generation_config_eos_ids_join_the_config_s():
    cfg = {**REAL_CONFIGS["qwen3-0.6b"], "eos_token_id": 151645}
    ours = arch_config_from_hf(cfg, {"eos_token_id": [151645, 151643]})
    assert ours.eos_token_ids == [151645, 151643]


@pytest.mark.parametrize(
    "base, change, field",
    [
        ("qwen3-0.6b", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
        ("qwen3-0.6b", {"hidden_act": "xielu"}, "hidden_act"),
        ("qwen3-0.6b", {"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
        ("qwen3-0.6b", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("qwen3-0.6b", {"architectures": ["Qwen3NextForCausalLM"]}, "Supported architectures"),
        ("gemma-3-1b", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma-3-1b", {"layer_types": ["chunked_attention"] * 7}, "layer_types"),
        ("phi-3-mini-4k", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "Phi-3 rope_scaling type 'linear'"),
        ("mixtral-8x7b", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ("opt-125m", {"activation_function": "gelu_10"}, "hidden_act"),
    ],
)
def test_settings_pagedllm_does_not_compute_are_refused_naming_the_field(base, change, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.").replace("(", r"\(")):
        arch_config_from_hf({**REAL_CONFIGS[base], **change})


def test_a_plain_config_stays_plain_data():
    """ModelArchConfig crosses to tensor-parallel workers: plain values only."""
    import dataclasses
    import pickle

    ours = arch_config_from_hf(REAL_CONFIGS["qwen3-30b-a3b"])
    assert pickle.loads(pickle.dumps(ours)) == ours
    assert all(not hasattr(v, "dtype") for v in dataclasses.asdict(ours).values())
    assert isinstance(ours, ModelArchConfig)
