"""Random-weight models of the newer families for `pagedllm bench throughput`: a Qwen3-shaped
dense model and a Mixtral-shaped mixture of experts, with realistic proportions at a size a CPU
runs in minutes (no weights can be downloaded here). Each folder holds a transformers config,
safetensors weights and the default model's tokenizer (49152 tokens, which both share).

    python benchmarks/family_models.py --out /tmp/family_models [--shapes qwen3 mixtral]
    pagedllm bench throughput /tmp/family_models/qwen3 --dataset alpaca --num-prompts 32
    pagedllm bench throughput /tmp/family_models/mixtral --dataset alpaca --num-prompts 32
"""

from __future__ import annotations

import argparse
from pathlib import Path

SHAPES = {
    # Qwen3-0.6B's proportions, narrower: q/k norms, head_dim (128) independent of hidden / heads
    # (64), GQA 2:1, tied embeddings.
    "qwen3": ("Qwen3", dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=128, vocab_size=49152, max_position_embeddings=4096,
                            rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6)),
    # Mixtral-8x7B's proportions, narrower: 8 experts, 2 per token, GQA 4:1.
    "mixtral": ("Mixtral", dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                                num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=49152,
                                max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False,
                                rms_norm_eps=1e-5)),
}


def build(shape: str, out: Path, seed: int = 0) -> Path:
    """The random model of `shape` saved under `out/shape` (with the default tokenizer)."""
    import torch
    import transformers

    from pagedllm.transformers_utils import get_tokenizer, resolve_model

    family, kwargs = SHAPES[shape]
    config = getattr(transformers, f"{family}Config")(**kwargs, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    folder = out / shape
    model.save_pretrained(str(folder))
    get_tokenizer(resolve_model(None)).save_pretrained(str(folder))
    total = sum(p.numel() for p in model.parameters())
    print(f"{shape}: {total / 1e6:.1f}M parameters -> {folder}")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    args = parser.parse_args()
    for shape in args.shapes:
        build(shape, args.out)


if __name__ == "__main__":
    main()
