"""`pagedllm bench sharing`: what block sharing saves (the paper's Figures 15 and 17).

Part 1, memory: the same requests with parallel sampling (n = 2, 4, 6) or beam search
(width 2, 4, 6) run with block sharing on and off, with a KV cache large enough that nothing is
preempted, so both runs take the same steps. Reported: KV blocks in use, averaged over the
steps and at the peak, and the saving. (The paper: 6.1-9.8% for parallel sampling and
37.6-55.2% for beam search on Alpaca; 16.2-30.5% and 44.3-66.3% on ShareGPT.)

Part 2, shared prefix: requests that all start with the same few-shot prefix (1 and 5
examples), with prefix caching on and off; the prefix is computed once before timing, as a
registered system prompt would be. Reported: requests/s and the speed-up. (The paper: 1.67x
with a 1-shot prefix, 3.58x with 5-shot, on LLaMA-13B.)
"""

from __future__ import annotations

import argparse
import random
import time

from pagedllm.bench.datasets import sample_requests
from pagedllm.bench.progress import Progress
from pagedllm.bench.report import format_table, write_json
from pagedllm.entrypoints.cli_args import add_engine_args, engine_args_from


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sharing", help="KV blocks saved by sharing; prefix-caching throughput")
    add_engine_args(p)
    p.add_argument("--datasets", nargs="+", default=["alpaca", "sharegpt"], choices=("alpaca", "sharegpt"))
    p.add_argument("--num-prompts", type=int, default=8, help="requests per memory run")
    p.add_argument("--max-output-len", type=int, default=None, help="cap output lengths (to shorten runs)")
    p.add_argument("--widths", type=int, nargs="+", default=[2, 4, 6], help="n for sampling, width for beams")
    p.add_argument("--prefix-shots", type=int, nargs="+", default=[1, 5])
    p.add_argument("--prefix-requests", type=int, default=32)
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-prefix", action="store_true")
    p.add_argument("--output-json", default="results/bench_sharing.json")
    p.set_defaults(func=run)


def _engine(engine_args, **overrides):
    from dataclasses import replace

    from pagedllm.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(replace(engine_args, **overrides))


def _blocks_in_use(engine, requests, params_for) -> dict:
    for i, req in enumerate(requests):
        engine.add_request(str(i), req.prompt_token_ids, params_for(req))
    samples = []
    progress = Progress("bench sharing")
    num_finished = 0
    while engine.has_unfinished_requests():
        num_finished += sum(o.finished for o in engine.step())
        progress.update(num_finished, len(requests), "requests done")
        stats = engine.get_stats()
        samples.append(stats.num_total_blocks - stats.num_free_blocks)
    stats = engine.get_stats()
    return {"mean": sum(samples) / len(samples), "peak": max(samples), "preemptions": stats.num_preemptions, "copies": stats.num_copy_on_writes}


def memory_rows(engine_args, datasets, num_prompts, widths, max_output_len) -> list[dict]:
    from pagedllm.sampling_params import SamplingParams

    rows = []
    for dataset in datasets:
        for method in ("parallel", "beam"):
            for width in widths:
                def params_for(req, width=width, method=method):
                    if method == "parallel":
                        return SamplingParams(n=width, temperature=1.0, seed=0, max_tokens=req.output_len, ignore_eos=True)
                    return SamplingParams(n=width, best_of=width, use_beam_search=True, temperature=0, max_tokens=req.output_len, ignore_eos=True)

                result = {}
                for sharing in (True, False):
                    Progress("bench sharing").phase(f"{dataset}, {method} {width}, block sharing {'on' if sharing else 'off'}")
                    engine = _engine(engine_args, enable_block_sharing=sharing, enable_prefix_caching=False)
                    requests = sample_requests(dataset, num_prompts, engine.max_model_len, engine.arch.vocab_size)
                    if max_output_len:
                        requests = [type(r)(r.prompt_token_ids, min(r.output_len, max_output_len)) for r in requests]
                    result[sharing] = _blocks_in_use(engine, requests, params_for)
                    engine.shutdown()
                shared, unshared = result[True], result[False]
                rows.append(
                    {
                        "dataset": dataset,
                        "method": f"{method} {'n' if method == 'parallel' else 'width'}={width}",
                        "blocks_shared": shared["mean"],
                        "blocks_unshared": unshared["mean"],
                        "saving_pct": 100 * (1 - shared["mean"] / unshared["mean"]),
                        "peak_saving_pct": 100 * (1 - shared["peak"] / unshared["peak"]),
                        "preemptions": shared["preemptions"] + unshared["preemptions"],
                    }
                )
                print(f"{dataset} {rows[-1]['method']}: {rows[-1]['saving_pct']:.1f}% fewer blocks", flush=True)
    return rows


def prefix_rows(engine_args, shots_list, num_requests) -> list[dict]:
    from pagedllm.sampling_params import SamplingParams

    rows = []
    rng = random.Random(0)
    for shots in shots_list:
        result = {}
        for caching in (False, True):
            Progress("bench sharing").phase(f"{shots}-shot prefix, prefix caching {'on' if caching else 'off'}")
            engine = _engine(engine_args, enable_prefix_caching=caching)
            vocab = engine.arch.vocab_size
            # Translation-like few-shot prompts: ~68-token examples, a ~20-token query, short answers.
            example = lambda: [rng.randint(100, vocab - 1) for _ in range(68)]  # noqa: E731
            rng.seed(shots)
            prefix = [t for _ in range(shots) for t in example()]
            queries = [[rng.randint(100, vocab - 1) for _ in range(rng.randint(12, 28))] for _ in range(num_requests)]
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
            engine.add_request("warmup", prefix + queries[0], SamplingParams(temperature=0, max_tokens=1))
            while engine.has_unfinished_requests():
                engine.step()
            start = time.perf_counter()
            for i, q in enumerate(queries):
                engine.add_request(str(i), prefix + q, params)
            while engine.has_unfinished_requests():
                engine.step()
            elapsed = time.perf_counter() - start
            stats = engine.get_stats()
            result[caching] = {"elapsed": elapsed, "hit_rate": stats.prefix_cache_hits / max(1, stats.prefix_cache_queries)}
            engine.shutdown()
        rows.append(
            {
                "shots": shots,
                "prefix_tokens": 68 * shots,
                "requests": num_requests,
                "req_per_s_off": num_requests / result[False]["elapsed"],
                "req_per_s_on": num_requests / result[True]["elapsed"],
                "speedup": result[False]["elapsed"] / result[True]["elapsed"],
                "hit_rate_on": result[True]["hit_rate"],
            }
        )
        print(f"{shots}-shot prefix: {rows[-1]['speedup']:.2f}x with prefix caching", flush=True)
    return rows


def run(args: argparse.Namespace) -> int:
    engine_args = engine_args_from(args)
    results = {}
    if not args.skip_memory:
        rows = memory_rows(engine_args, args.datasets, args.num_prompts, args.widths, args.max_output_len)
        print(format_table(rows, ["dataset", "method", "blocks_shared", "blocks_unshared", "saving_pct", "peak_saving_pct", "preemptions"]))
        results["memory"] = rows
    if not args.skip_prefix:
        rows = prefix_rows(engine_args, args.prefix_shots, args.prefix_requests)
        print(format_table(rows))
        results["prefix"] = rows
    path = write_json(args.output_json, "sharing", {k: v for k, v in vars(args).items() if k != "func"}, results)
    print(f"wrote {path}")
    return 0
