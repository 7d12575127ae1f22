"""`pagedllm bench dtype`: bfloat16 against float32 on the same prompts: how often the greedy
continuations agree (all of the first N tokens, and the shared prefix length) and how fast each
dtype decodes. `float32+int8` is float32 with the quantized projections on int8 activations
(`int8_activations="on"`): the bar it is held to is the agreement bfloat16 gets."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from pagedllm.bench.report import format_table, write_json
from pagedllm.entrypoints.cli_args import add_engine_args, engine_args_from

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for a good night's sleep.",
    "Explain photosynthesis to a ten-year-old.",
    "Write a haiku about the ocean.",
    "What is the difference between a list and a tuple in Python?",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What are prime numbers? Give five examples.",
    "How do vaccines work?",
    "Suggest a name for a coffee shop.",
    "What causes the seasons on Earth?",
    "Write a short limerick about a cat.",
    "List four planets of the solar system.",
    "What is machine learning?",
    "How many days are there in a leap year?",
]


# Each variant: (dtype, int8_activations).
VARIANTS = {"float32": ("float32", "off"), "bfloat16": ("bfloat16", "off"), "float16": ("float16", "off"),
            "float32+int8": ("float32", "on")}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dtype", help="bfloat16 vs float32: greedy agreement and speed")
    add_engine_args(p)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=VARIANTS,
                   help="the first is the reference; float32+int8: float32 with int8 activations")
    p.add_argument("--num-tokens", type=int, default=32)
    p.add_argument("--output-json", default="results/bench_dtype.json")
    p.set_defaults(func=run)


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    base = engine_args_from(args)
    params = SamplingParams(temperature=0, max_tokens=args.num_tokens, ignore_eos=True)
    runs = {}
    for dtype in args.dtypes:
        engine_args = replace(base, dtype=VARIANTS[dtype][0], int8_activations=VARIANTS[dtype][1])
        kwargs = {k: v for k, v in vars(engine_args).items() if k not in ("model", "extra")}
        llm = LLM(engine_args.model, **kwargs)
        conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
        llm.chat(conversations[:2], params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.chat(conversations, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        runs[dtype] = {"tokens": [o.outputs[0].token_ids for o in outputs], "texts": [o.outputs[0].text for o in outputs],
                       "tok_per_s": len(QUESTIONS) * args.num_tokens / elapsed}
        llm.llm_engine.shutdown()
    reference = args.dtypes[0]
    rows = []
    for dtype in args.dtypes:
        prefixes = [_shared_prefix(a, b) for a, b in zip(runs[reference]["tokens"], runs[dtype]["tokens"])]
        rows.append(
            {
                "dtype": dtype,
                "prompts": len(QUESTIONS),
                f"all_{args.num_tokens}_agree": sum(p == args.num_tokens for p in prefixes),
                "agree_pct": 100 * sum(p == args.num_tokens for p in prefixes) / len(prefixes),
                "mean_shared_prefix": sum(prefixes) / len(prefixes),
                "tok_per_s": runs[dtype]["tok_per_s"],
            }
        )
    print(format_table(rows))
    for q, *texts in zip(QUESTIONS[:3], *(runs[d]["texts"] for d in args.dtypes)):
        print(f"\nQ: {q}")
        for dtype, text in zip(args.dtypes, texts):
            print(f"  {dtype}: {text!r}")
    config = {k: v for k, v in vars(args).items() if k != "func"}
    path = write_json(args.output_json, "dtype", config, {"rows": rows, "texts": {d: runs[d]["texts"] for d in args.dtypes}})
    print(f"wrote {path}")
    return 0
