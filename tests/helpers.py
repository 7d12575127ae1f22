"""Builders and oracles shared by the tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TINY_ARCHS = ("llama", "mistral", "qwen2")
TINY_VOCAB = 49152  # the default model's tokenizer, so tiny models handle real text


def build_tiny_model(path: Path, arch: str, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A few-layer random model of `arch`, saved with safetensors and the default tokenizer.

    Weights are drawn wider than usual (initializer_range 0.2) so greedy decoding has clear
    winners rather than near-ties that float rounding could flip.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
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
    kwargs.update(overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
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
