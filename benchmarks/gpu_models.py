"""Random-weight models for the GPU check, built on the GPU machine itself (the default model's
file is too large to travel, and nothing can be downloaded there).

Shapes: SmolLM2-135M's (the default model's architecture, for correctness against
`transformers`), a ~1B Llama (Llama-3.2-1B's shape, for speed), and small models of the newer
families for their greedy check on the GPU: Qwen3 (q/k norms, head_dim apart from hidden/heads),
Gemma 3 (sliding-window layers shorter than the prompts beside global ones, two rope bases) and
Qwen3-MoE (routed experts). Each folder holds a
`transformers` config, safetensors weights and a byte-level tokenizer made here (every byte is a
token; the rest of the vocabulary is filler), which is all the engine and `transformers` need;
`<out>/tokenizer` holds the tokenizer alone, for the tests' tiny models.

    python benchmarks/gpu_models.py --out /tmp/gpu_models [--shapes smollm2 llama-1b]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SHAPES = {
    # SmolLM2-135M-Instruct's architecture (the default model).
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    tie_word_embeddings=True, rms_norm_eps=1e-5),
    # Llama-3.2-1B's architecture (context capped: random weights need no more).
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096, rope_theta=500000.0,
                     tie_word_embeddings=True, rms_norm_eps=1e-5),
    "qwen3": dict(family="Qwen3", hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, vocab_size=49152, max_position_embeddings=4096, rope_theta=1e6,
                  tie_word_embeddings=True, rms_norm_eps=1e-6),
    "gemma3": dict(family="Gemma3Text", hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=49152,
                   max_position_embeddings=4096, sliding_window=64, sliding_window_pattern=3, query_pre_attn_scalar=64,
                   rms_norm_eps=1e-6, tie_word_embeddings=True,
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "qwen3-moe": dict(family="Qwen3Moe", hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, vocab_size=49152,
                      max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False, rms_norm_eps=1e-6),
}
FAMILY_SHAPES = ("qwen3", "gemma3", "qwen3-moe")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer without merges: 3 special tokens, the 256 byte symbols, filler."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(alphabet):
        vocab[symbol] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<filler_{len(vocab)}>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=SPECIAL_TOKENS[1],
                                   eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[0])


def build(shape: str, folder: Path, dtype: str, initializer_range: float, seed: int = 0) -> Path:
    """Save a random model of `shape` in `folder` (skipped if it is already there)."""
    import torch
    import transformers

    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = dict(SHAPES[shape])
    family = kwargs.pop("family", "Llama")
    config_cls = getattr(transformers, "Gemma3TextConfig" if family == "Gemma3Text" else f"{family}Config")
    model_cls = getattr(transformers, "Gemma3ForCausalLM" if family == "Gemma3Text" else f"{family}ForCausalLM")
    config = config_cls(**kwargs, initializer_range=initializer_range, bos_token_id=1, eos_token_id=0,
                        pad_token_id=0, torch_dtype=dtype)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = model_cls(config).to(getattr(torch, dtype)).eval()
        if family == "Gemma3Text":  # transformers starts Gemma's norms at 0 (a weight of 1): draw them
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name.endswith("norm.weight"):
                        param.normal_(0.0, 0.2)
    model.save_pretrained(str(folder))
    byte_tokenizer(config.vocab_size).save_pretrained(str(folder))
    (folder / "pagedllm_shape.json").write_text(json.dumps({"shape": shape, "dtype": dtype, "seed": seed}))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["smollm2", "llama-1b"])
    args = parser.parse_args()
    # The tests' tiny models take their tokenizer from a folder of its own (tests/conftest.py,
    # PAGEDLLM_TEST_TOKENIZER_DIR): the default model's vocabulary size.
    tokenizer_dir = args.out / "tokenizer"
    if not tokenizer_dir.exists():
        byte_tokenizer(SHAPES["smollm2"]["vocab_size"]).save_pretrained(str(tokenizer_dir))
    print(f"tokenizer: {tokenizer_dir}")
    for shape in args.shapes:
        # Wider weights than a trained model's give clear greedy winners (no near-ties for
        # rounding to flip); the speed model keeps the usual scale and the checkpoint dtype.
        if shape == "smollm2" or shape in FAMILY_SHAPES:
            path = build(shape, args.out / shape, "float32", initializer_range=0.1)
        else:
            path = build(shape, args.out / shape, "bfloat16", initializer_range=0.02)
        print(f"{shape}: {path}")


if __name__ == "__main__":
    main()
