"""What top-k, top-p and min-p cost a decode step: the sampler's one-pass filtered draw
(`ops.sample_filtered_rows`, csrc/sampling_filtered.cpp) against the torch path it replaces on a
CPU (`filter_top_k_top_p_min_p`: top-k by torch.topk, top-p by sorting the whole row, then the
draw over the masked row), in one process, alternated:

1. the draw alone, on rows of logits of the vocabularies users serve (49,152 SmolLM2, 151,936
   Qwen, 262,144 Gemma 3), 1 and 16 rows, logits N(0, 3^2) (a distribution as peaked as a
   model's at a middling position);
2. single-stream decode of a model (`--model`: the embedded default, or a GGUF file such as the
   real Gemma 3 270M), tokens per second with each sampling setting, the two paths alternated.

    python benchmarks/sampling_filters.py [--model FILE] [--output-json results/sampling_filters.json]

Prints the tables with the CPU's model and flags and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.bench.report import format_table, write_json
from pagedllm.kernels import ops
from pagedllm.sampling import filter_top_k_top_p_min_p
from pagedllm.sampling import sampler as sampler_module

# (name, temperature, top_k, top_p, min_p): what clients send (llama.cpp's defaults: top-k 40,
# top-p 0.95, min-p 0.05; Gemma 3's generation config: top-k 64, top-p 0.95).
SETTINGS = [
    ("temperature 0.8", 0.8, 0, 1.0, 0.0),
    ("top-k 40", 0.8, 40, 1.0, 0.0),
    ("top-p 0.9", 0.8, 0, 0.9, 0.0),
    ("min-p 0.05", 0.8, 0, 1.0, 0.05),
    ("top-k 64, top-p 0.95", 1.0, 64, 0.95, 0.0),
    ("llama.cpp defaults", 0.8, 40, 0.95, 0.05),
]
VOCABS = (49_152, 151_936, 262_144)


def torch_path(x, temperature, top_k, top_p, min_p, uniform):
    """What the sampler did before the one-pass kernel: mask by the filters, then draw."""
    masked = filter_top_k_top_p_min_p(x / temperature.unsqueeze(1), top_k, top_p, min_p)
    return ops.sample_rows(masked, torch.ones_like(temperature), uniform)


def time_draws(fn, x, setting, repeats: int) -> float:
    _, t, k, p, m = setting
    rows = x.shape[0]
    temperature = torch.full((rows,), t)
    times = []
    for _ in range(repeats):
        uniform = torch.rand(rows)
        start = time.perf_counter()
        fn(x, temperature, [k] * rows, [p] * rows, [m] * rows, uniform)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def draws_alone(repeats: int) -> list[dict]:
    out = []
    for vocab in VOCABS:
        for rows in (1, 16):
            x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 3
            for setting in SETTINGS[1:]:
                old = time_draws(torch_path, x, setting, repeats)
                new = time_draws(ops.sample_filtered_rows, x, setting, repeats)
                out.append({"vocab": vocab, "rows": rows, "setting": setting[0], "torch_ms": old * 1e3,
                            "one_pass_ms": new * 1e3, "x": old / new})
    return out


def decode(model: str, tokens: int, rounds: int) -> list[dict]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model, max_model_len=2048)
    prompt = ["Write a short story about a lighthouse keeper who finds a message in a bottle."]
    one_pass = ops.sample_filtered_rows
    best: dict[tuple[str, str], float] = {}
    for _ in range(rounds):
        for name, t, k, p, m in [("greedy", 0.0, 0, 1.0, 0.0), *SETTINGS]:
            params = SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, max_tokens=tokens, ignore_eos=True, seed=0)
            for path in ("torch", "one pass"):
                sampler_module.fused_ops.sample_filtered_rows = torch_path if path == "torch" else one_pass
                try:
                    start = time.perf_counter()
                    llm.generate(prompt, params, use_tqdm=False)
                    elapsed = time.perf_counter() - start
                finally:
                    sampler_module.fused_ops.sample_filtered_rows = one_pass
                best[name, path] = min(best.get((name, path), float("inf")), elapsed)
    out = []
    for name in dict.fromkeys(n for n, _ in best):
        old, new = tokens / best[name, "torch"], tokens / best[name, "one pass"]
        out.append({"setting": name, "torch_tok_per_s": old, "one_pass_tok_per_s": new, "x": new / old})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="a model name, folder or GGUF file")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per run")
    parser.add_argument("--rounds", type=int, default=3, help="decode runs per setting and path (best kept)")
    parser.add_argument("--repeats", type=int, default=21, help="timed draws per setting and path (median)")
    parser.add_argument("--output-json", default="results/sampling_filters.json")
    args = parser.parse_args()
    alone = draws_alone(args.repeats)
    print("the draw alone (median ms):")
    print(format_table(alone))
    decoded = decode(args.model, args.tokens, args.rounds)
    print(f"\nsingle-stream decode of {args.model}, {args.tokens} tokens (best of {args.rounds}):")
    print(format_table(decoded))
    path = write_json(args.output_json, "sampling_filters", vars(args), {"draw_alone": alone, "decode": decoded})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
