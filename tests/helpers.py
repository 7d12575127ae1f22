"""Builders and oracles shared by the tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TINY_ARCHS = ("llama", "mistral", "qwen2")
# The families added with the model registry (tests/test_families.py).
FAMILY_ARCHS = ("qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3", "phi3", "opt", "granite")
TINY_VOCAB = 49152  # the default model's tokenizer, so tiny models handle real text

# Each family's tiny shape, over the common one below: GQA everywhere it exists, a head size
# that is not hidden / heads where the family allows it, experts, windows, soft-caps and the
# rotary variants each family has (values chosen so each feature changes the logits).
_FAMILY_SHAPES: dict[str, dict] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"head_dim": 32},
    "qwen3_moe": {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                  "norm_topk_prob": True},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64},
    "gemma2": {"num_hidden_layers": 3, "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8,
               "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, "tie_word_embeddings": True},
    "gemma3": {"num_hidden_layers": 4, "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 8,
               "sliding_window_pattern": 2, "final_logit_softcapping": 3.0, "tie_word_embeddings": True,
               "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "phi3": {"pad_token_id": 0},
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64, "max_position_embeddings": 1024, "pad_token_id": 1},
    "granite": {"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.1,
                "logits_scaling": 4.0},
}


def _family_classes(arch: str):
    import transformers

    names = {
        "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe",
        "mixtral": "Mixtral", "gemma2": "Gemma2", "gemma3": "Gemma3", "phi3": "Phi3", "opt": "OPT",
        "granite": "Granite",
    }
    config_name = "Gemma3TextConfig" if arch == "gemma3" else f"{names[arch]}Config"
    return getattr(transformers, config_name), getattr(transformers, f"{names[arch]}ForCausalLM")


def tiny_hf_model(arch: str, seed: int = 0, **overrides):
    """A few-layer random transformers model of `arch` (the oracle), not saved.

    Weights are drawn wider than usual (initializer_range 0.2) so greedy decoding has clear
    winners rather than near-ties that float rounding could flip.
    """
    config_cls, model_cls = _family_classes(arch)
    kwargs = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "opt":
        for key in ("intermediate_size", "num_key_value_heads", "rope_theta", "initializer_range"):
            del kwargs[key]
        kwargs["init_std"] = 0.2
    kwargs.update(_FAMILY_SHAPES[arch])
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if arch in ("gemma2", "gemma3"):  # transformers starts Gemma's norms at 0 (a weight of 1): draw them
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.2)
    return model


def build_tiny_model(path: Path, arch: str, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """`tiny_hf_model(arch)` saved with safetensors and the default tokenizer."""
    model = tiny_hf_model(arch, seed, **overrides)
    model.save_pretrained(str(path))
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, path / item.name)
    return path


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """transformers' greedy continuation of one unpadded prompt (the oracle)."""
    ids = torch.tensor([prompt])
    # With ignore_eos, EOS may be generated and generation goes on past it (not suppressed).
    kwargs = {"eos_token_id": -1} if ignore_eos else {}
    with torch.inference_mode():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def random_prompts(count: int, lengths: list[int], seed: int = 0, low: int = 100, high: int = 40000) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, (lengths[i % len(lengths)],), generator=gen).tolist() for i in range(count)]
