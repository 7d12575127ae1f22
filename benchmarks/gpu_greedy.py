"""Greedy output of pagedllm on a GPU (Triton attention) against `transformers` on the same GPU
and the same weights, token for token.

Prompts of varied lengths run in one batch through the engine (continuous batching, a shared
prefix for the prefix cache, chunked prompts with a small --max-num-batched-tokens), each alone
through `transformers.generate`. In float32 every token must match; in bfloat16 the two
implementations round differently, so the check reports how many tokens agree before the first
difference instead of failing on it, against `transformers` in bfloat16 and in float32; at each
first difference it measures, in float32, the margin between the token `transformers` chose and
the one pagedllm chose: a margin within bfloat16's rounding of the logits (2**-7 of the largest)
is a rounding tie, not an error.

    python benchmarks/gpu_greedy.py --model /tmp/gpu_models/smollm2 [--dtypes float32 bfloat16]
    python benchmarks/gpu_greedy.py --model /tmp/gpu_models/gemma3 --dtypes float32  # a family
"""

from __future__ import annotations

import argparse
import gc
import json
import sys

import torch


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 7, 16, 17, 100, 250, 600, 1000]
    out = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    shared = out[-2][:300]  # a long shared prefix: the second run of it hits the prefix cache
    out += [shared + [5, 6, 7], shared + [8, 9]]
    return out


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=-1, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def first_difference(expected: list[int], got: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))


def tie_margins(model, batch, expected, got) -> list[dict]:
    """At each prompt's first difference, the float32 logits' margin between the reference's
    token and pagedllm's (relative to the largest logit there), and whether it is a rounding tie."""
    out = []
    for prompt, e, g in zip(batch, expected, got):
        n = first_difference(e, g)
        if n >= min(len(e), len(g)):
            continue
        ids = torch.tensor([prompt + e[:n]], device=model.device)
        with torch.inference_mode():
            logits = model(ids).logits[0, -1].float()
        margin = float(logits[e[n]] - logits[g[n]])
        scale = max(float(logits.abs().max()), 1.0)
        out.append({"position": n, "margin": margin, "relative": margin / scale, "tie": margin <= scale * 2**-7})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--device", default="cuda", help="cpu only to try the script itself on a CPU")
    parser.add_argument("--attention-backend", default="triton")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    rows, ok = [], True
    float32_reference = None
    for dtype in args.dtypes:
        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, dtype)).to(args.device).eval()
        batch = prompts(hf.config.vocab_size)
        expected = [hf_greedy(hf, p, args.max_tokens) for p in batch]
        if dtype == "float32":
            float32_reference = expected
        del hf
        empty_cache()
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        runs = {}
        for eager in (False, True):  # decode steps through CUDA graphs, then every step eagerly
            llm = LLM(args.model, device=args.device, dtype=dtype, attention_backend=args.attention_backend,
                      max_model_len=2048, max_num_batched_tokens=512, gpu_memory_utilization=0.5, enforce_eager=eager)
            outputs = llm.generate(batch, params, use_tqdm=False)
            graphs = getattr(llm.llm_engine.executor.worker.runner, "graphs", None)
            runs[eager] = ([o.outputs[0].token_ids for o in outputs], llm.llm_engine.get_stats(),
                           graphs.replays if graphs is not None else 0)
            del llm, graphs  # the graphs hold the model, and through it the KV cache
            gc.collect()
            empty_cache()
        got, stats, replays = runs[False]
        same_as_eager = sum(a == b for a, b in zip(got, runs[True][0]))
        agree = [first_difference(e, g) for e, g in zip(expected, got)]
        identical = sum(e == g for e, g in zip(expected, got))
        row = {"model": args.model, "dtype": dtype, "prompts": len(batch), "identical": identical,
               "tokens_agreeing_before_first_difference": agree, "max_tokens": args.max_tokens,
               "tokens_agreeing": sum(agree), "tokens": len(batch) * args.max_tokens,
               "prefix_cache_hits": stats.prefix_cache_hits, "prefix_cache_queries": stats.prefix_cache_queries,
               "graph_replays": replays, "identical_to_eager": same_as_eager}
        line = (f"greedy {dtype}: {identical}/{len(batch)} prompts identical to transformers {dtype} on {args.device} "
                f"({sum(agree)}/{row['tokens']} tokens before the first differences)")
        if dtype != "float32":
            # Against float32 transformers too, and at each first difference: a rounding tie?
            if float32_reference is None:
                hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device).eval()
                float32_reference = [hf_greedy(hf, p, args.max_tokens) for p in batch]
            else:
                hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device).eval()
            vs32 = [first_difference(e, g) for e, g in zip(float32_reference, got)]
            ties = tie_margins(hf, batch, float32_reference, got)
            del hf
            empty_cache()
            row.update(identical_to_float32=sum(e == g for e, g in zip(float32_reference, got)),
                       tokens_agreeing_with_float32=sum(vs32), differences_vs_float32=ties)
            line += (f"; vs transformers float32: {row['identical_to_float32']}/{len(batch)} identical, "
                     f"{sum(vs32)}/{row['tokens']} tokens, {sum(t['tie'] for t in ties)}/{len(ties)} first differences "
                     "are rounding ties")
        rows.append(row)
        print(line + f"; {same_as_eager}/{len(batch)} identical with and without CUDA graphs ({replays} graph replays); "
              f"tokens agreeing before the first difference: {agree}", flush=True)
        print(json.dumps(row), flush=True)
        if dtype == "float32" and identical != len(batch):
            ok = False
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if ok else 1


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
