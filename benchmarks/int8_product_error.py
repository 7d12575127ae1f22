"""How far each int8-activation product of a GGUF model is from its float32 product, beside how far
llama.cpp's activation quantization would be, on the model's real weights and on the activations
its first tokens of the benchmark text bring to each projection.

    python benchmarks/int8_product_error.py                      # the embedded model
    python benchmarks/int8_product_error.py ~/.cache/pagedllm/gguf-models/gemma-3-270m-q4_k_m.gguf

Per weight type: the mean over the model's projections of |y_int8 - y| / |y| (Frobenius norms,
y the float32-activation product), for pagedllm's kernel (`matmul(..., int8=True)`) and for
llama.cpp's way emulated: x quantized per 32 values (the legacy types' Q8_0/Q8_1) or per 256 (the
K-quants' Q8_K), d = max|x| / 127, q = round(x / d), times the dequantized weight, so that the
weight's constant term (Q4_1's minimum, Q4_K's) meets the same rounded x as the rest
(`pagedllm bench numerics`, docs/gguf-kernels.md "Numerics of int8 activations").
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parent / "data" / "alice-in-wonderland.txt"


def llama_cpp_way(x: torch.Tensor, weight: torch.Tensor, block: int) -> torch.Tensor:
    """x W^T with x rounded as llama.cpp quantizes activations (per `block`, 127 levels a side)."""
    blocks = x.view(x.shape[0], -1, block)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(blocks / d), torch.zeros_like(blocks))
    return (q * d).view_as(x) @ weight.T


def projection_inputs(runner, tokens: list[int]) -> dict[str, torch.Tensor]:
    """The input of each quantized projection in a forward pass over `tokens` (the first call)."""
    from pagedllm.model import layers
    from pagedllm.model.quant import method_layers

    names = {id(m): name for name, m in method_layers(runner.model).items()}
    inputs: dict[str, torch.Tensor] = {}
    linear = layers.linear

    def recording(x, layer, bias=None):
        if id(layer) in names:
            inputs.setdefault(names[id(layer)], x.detach().clone())
        return linear(x, layer, bias)

    runner.model.fused_layers = None  # every projection through `layers.linear`
    layers.linear = recording
    try:
        runner.scored_logits(tokens, range(len(tokens) - 1, len(tokens)))
    finally:
        layers.linear = linear
    return inputs


def main() -> None:
    from pagedllm.bench.numerics import ChunkRunner, text_tokens
    from pagedllm.kernels import gguf
    from pagedllm.model.quant import method_layers
    from pagedllm.transformers_utils import get_tokenizer, resolve_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None, help="a GGUF file (default: the embedded model)")
    parser.add_argument("--tokens", type=int, default=16, help="rows of x: the text's first tokens")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    source = resolve_model(args.model)
    tokens, _ = text_tokens(get_tokenizer(source), TEXT.read_text())
    runner = ChunkRunner(source.path, args.tokens, "off", step=args.tokens)
    layers = method_layers(runner.model)
    errors = defaultdict(lambda: [[], []])  # weight type -> (pagedllm's, llama.cpp's)
    with torch.inference_mode():
        for name, x in projection_inputs(runner, tokens[: args.tokens]).items():
            for part in layers[name].quant_method.parts:
                exact = gguf.matmul(x, part, int8=False)
                for i, y in enumerate((gguf.matmul(x, part, int8=True),
                                       llama_cpp_way(x, gguf.dequantize_rows(part), gguf.activation_block(part.qtype)))):
                    errors[part.qtype][i].append(float((y - exact).norm() / exact.norm()))
    print(f"{source.path.name}: relative error of int8-activation products, mean over projections ({args.tokens} rows)")
    print(f"{'type':>6}  {'products':>8}  {'pagedllm':>9}  {'llama.cpp way':>13}  ratio")
    for qtype, (ours, theirs) in sorted(errors.items()):
        mean_ours, mean_theirs = sum(ours) / len(ours), sum(theirs) / len(theirs)
        print(f"{qtype:>6}  {len(ours):>8}  {mean_ours:>9.2e}  {mean_theirs:>13.2e}  {mean_ours / mean_theirs:.2f}")


if __name__ == "__main__":
    main()
