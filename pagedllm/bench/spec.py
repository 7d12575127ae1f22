"""`pagedllm bench spec`: speculative decoding against the same engine without it, one request at
a time (single stream), greedy, on two sets of chat prompts: input-grounded ones (repeat or edit
code, summaries that quote their source, the README's examples), where the output copies the
prompt, and ordinary chat, where it does not. The two engines (the same arguments, one with
`--speculative-config`) run in one process and take turns on each prompt; each prompt's rate is
its output tokens over the wall time of its whole request, the better of `--num-iters` runs.
Greedy outputs must be identical, token for token: a difference is reported (and fails). That
holds on float32 activations, which both engines use unless `--int8-activations` says otherwise
(the engine's default for a GGUF model is int8 activations where they pay, and a verified token's
products, several rows at once, may then run another way than a plain decode step's single row:
with `--int8-activations auto` or `on` a difference is reported but does not fail).

With `--llama-cpp`, llama.cpp runs the same GGUF file on the same prompt tokens (the chat
template applied by pagedllm) after the engines: `llama-server` with one slot, pagedllm's torch
thread count, greedy, exactly as many tokens as pagedllm's plain output (`ignore_eos`), once
plain and once with `--spec-type ngram-simple` (lookup `prompt_lookup_max` tokens, drafts of up
to `num_speculative_tokens`). Its rate is timed the same way, over the whole HTTP request;
`llama_same` says whether its plain output equals pagedllm's (numerics may differ, and with them
what speculation can accept).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import time
from pathlib import Path

from pagedllm.bench.report import format_table, write_json
from pagedllm.entrypoints.cli_args import add_engine_args, engine_args_from

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 16, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def _source_of(obj) -> str:
    return inspect.getsource(obj)


def _readme_example() -> str:
    readme = Path(__file__).resolve().parents[2] / "README.md"
    if readme.exists():
        text = readme.read_text()
        start = text.find("```python")
        if start != -1:
            end = text.find("```", start + 9)
            return text[start + 9 : end].strip()
    return 'from pagedllm import LLM, SamplingParams\n\nllm = LLM()\nprint(llm.generate("Hello")[0].outputs[0].text)'


_ARTICLE = (
    "PagedAttention stores the keys and values of each request in fixed-size blocks that need not be "
    "contiguous in memory. A block table maps each request's logical blocks to physical blocks, as an "
    "operating system maps virtual pages to frames. Because blocks are allocated on demand, a request "
    "wastes at most one partly filled block, and requests can share blocks: the samples of one prompt "
    "share the prompt's blocks, and a block is copied only when one of them writes into it. The authors "
    "report that this lets a server batch two to four times more requests in the same memory, which "
    "raises throughput by the same factor when memory is what limits the batch."
)


def grounded_prompts() -> list[tuple[str, str]]:
    """(name, user message) pairs whose answer copies much of the message."""
    from pagedllm.bench import report

    code = _source_of(report.format_table)
    code2 = _source_of(report.cpu_description)
    return [
        ("repeat-code", f"Repeat this Python function exactly, with no changes:\n\n```python\n{code}```"),
        ("rename-code", f"Rewrite this function with the parameter `rows` renamed to `records`; change nothing else:\n\n```python\n{code}```"),
        ("comment-code", f"Add a docstring line to this function and otherwise copy it unchanged:\n\n```python\n{code2}```"),
        ("quote-summary", f"Summarize this text, quoting its key sentences word for word:\n\n{_ARTICLE}"),
        ("readme-example", f"Copy this example and add a comment above each line:\n\n```python\n{_readme_example()}\n```"),
        ("repeat-text", f"Repeat the following paragraph exactly:\n\n{_ARTICLE}"),
    ]


# Modules whose short functions the grounded request set (`grounded_messages`) asks to copy or
# edit: plain Python that imports nothing heavy.
_SOURCE_MODULES = ("pagedllm.bench.report", "pagedllm.bench.datasets", "pagedllm.core.block_manager",
                   "pagedllm.core.scheduler", "pagedllm.engine.spec_decode", "pagedllm.sampling_params")


def _short_functions(min_lines: int = 6, max_lines: int = 30) -> list:
    """Functions and methods of `_SOURCE_MODULES` with min_lines..max_lines of source, in a fixed order."""
    import importlib

    found = {}
    for name in _SOURCE_MODULES:
        module = importlib.import_module(name)
        members = [m for _, m in inspect.getmembers(module)]
        members += [f for c in members if inspect.isclass(c) and c.__module__ == name for f in vars(c).values()]
        for obj in members:
            if inspect.isfunction(obj) and obj.__module__ == name and not obj.__name__.startswith("__"):
                try:
                    lines = inspect.getsource(obj).count("\n")
                except OSError:  # generated (a dataclass's methods)
                    continue
                if min_lines <= lines <= max_lines:
                    found[f"{name}.{obj.__qualname__}"] = obj
    return [found[k] for k in sorted(found)]


# What the grounded request set asks of each source: copy it, edit it lightly, or annotate it.
_GROUNDED_TASKS = (
    "Repeat this Python function exactly, with no changes:\n\n```python\n{code}```",
    "Rewrite this function with the name `{name}` changed to `{name}_v2`; change nothing else:\n\n```python\n{code}```",
    "Add a docstring line to this function and otherwise copy it unchanged:\n\n```python\n{code}```",
    "Copy this function and add a short comment above its first line:\n\n```python\n{code}```",
)


def grounded_messages(num: int, seed: int = 0) -> list[tuple[str, str]]:
    """`num` (user message, source) pairs whose answers copy most of the message: the tasks of
    `_GROUNDED_TASKS` over short functions of pagedllm's own code (the source), drawn with
    `seed`, each function once before any repeats."""
    import random
    import textwrap

    functions = _short_functions()
    rng = random.Random(seed)
    order = list(range(len(functions)))
    rng.shuffle(order)
    messages = []
    for i in range(num):
        fn = functions[order[i % len(order)]]
        code = textwrap.dedent(inspect.getsource(fn))
        task = _GROUNDED_TASKS[rng.randrange(len(_GROUNDED_TASKS))]
        messages.append((task.format(code=code, name=fn.__name__), code))
    return messages


def grounded_requests(tokenizer, num: int, max_model_len: int, seed: int = 0) -> list:
    """`bench throughput --dataset grounded`: `grounded_messages` in the chat template, each
    generating as many tokens as its source has and 16 more (about the answer's length; exactly
    that many, as every request of the throughput bench), within the context."""
    from pagedllm.bench.datasets import BenchRequest

    requests = []
    for message, code in grounded_messages(num, seed):
        text = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                             tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        output_len = min(len(tokenizer.encode(code, add_special_tokens=False)) + 16, max_model_len - len(prompt))
        if output_len < 1:
            raise ValueError(f"a grounded prompt of {len(prompt)} tokens leaves no room in a context of "
                             f"{max_model_len}; raise --max-model-len")
        requests.append(BenchRequest(prompt, output_len))
    return requests


def chat_prompts() -> list[tuple[str, str]]:
    return [
        ("chat-capital", "What is the capital of France, and what is it known for?"),
        ("chat-haiku", "Write a short poem about the sea."),
        ("chat-recursion", "Explain recursion to a ten-year-old."),
        ("chat-sleep", "Give me three tips for sleeping better."),
        ("chat-email", "Write a polite email asking my manager for a day off next Friday."),
        ("chat-history", "Tell me briefly about the history of the bicycle."),
    ]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("spec", help="speculative decoding vs none, single stream, grounded and chat prompts")
    add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-iters", type=int, default=2, help="runs per prompt and engine; the faster is kept")
    p.add_argument("--sets", nargs="+", choices=("grounded", "chat"), default=["grounded", "chat"])
    p.add_argument("--output-json", default="results/bench_spec.json")
    peer = p.add_argument_group("llama.cpp")
    peer.add_argument("--llama-cpp", action="store_true",
                      help="also llama-server on the same GGUF file, plain and with --spec-type ngram-simple")
    peer.add_argument("--llama-cpp-dir", help="the llama.cpp build (default: ~/.cache/pagedllm/llama.cpp/<version>; `pagedllm bench llama-cpp build`)")
    peer.add_argument("--llama-cpp-threads", type=int, default=None, help="llama-server's threads (default: pagedllm's torch threads)")
    peer.add_argument("--llama-cpp-ngram-size-n", type=int, default=None,
                      help="ngram-simple's lookup length (default: prompt_lookup_max)")
    peer.add_argument("--llama-cpp-ngram-size-m", type=int, default=None,
                      help="ngram-simple's longest draft (default: num_speculative_tokens)")
    p.set_defaults(func=run)


def _time_one(llm, token_ids: list[int], params) -> tuple[float, list[int]]:
    start = time.perf_counter()
    out = llm.generate([token_ids], params, use_tqdm=False)[0].outputs[0]
    return time.perf_counter() - start, list(out.token_ids)


def run(args: argparse.Namespace) -> int:
    import torch

    from pagedllm import LLM, SamplingParams
    from pagedllm.bench import llama_cpp_peer

    engine_args = engine_args_from(args)
    exact = engine_args.int8_activations in (None, "off")
    defaulted = engine_args.int8_activations is None
    if defaulted:  # the identity check is exact on float32 activations
        engine_args.int8_activations = "off"
    spec_text = engine_args.speculative_config or DEFAULT_SPEC
    spec = json.loads(spec_text) if isinstance(spec_text, str) else spec_text
    peer = None
    if args.llama_cpp:  # checked before the engines load: a missing build fails at once
        try:
            peer = (llama_cpp_peer.built_binaries(Path(args.llama_cpp_dir) if args.llama_cpp_dir else None),
                    llama_cpp_peer.gguf_file(engine_args.model))
        except llama_cpp_peer.LlamaCppPeerError as exc:
            print(exc)
            return 1
    base_kwargs = {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)}
    base_kwargs["speculative_config"] = None
    model = base_kwargs.pop("model")
    base_kwargs.pop("generation_config", None)
    if defaulted:
        print("int8 activations off (float32, where speculation is exact); --int8-activations auto times llama.cpp's "
              "numerics, whose outputs may differ with speculation by int8's rounding")
    plain = LLM(model, **base_kwargs)
    speculative = LLM(model, **{**base_kwargs, "speculative_config": spec})
    threads = args.llama_cpp_threads or torch.get_num_threads()  # before a step can lower it
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    sets = {"grounded": grounded_prompts(), "chat": chat_prompts()}
    rows, mismatches, prompt_tokens, plain_tokens = [], [], [], []
    warm = plain.apply_chat_template([{"role": "user", "content": "Hi"}])
    for llm in (plain, speculative):  # first-call costs stay out of the timings
        _time_one(llm, warm, SamplingParams(temperature=0, max_tokens=8))
    for set_name in args.sets:
        for name, message in sets[set_name]:
            token_ids = plain.apply_chat_template([{"role": "user", "content": message}])
            prompt_tokens.append(token_ids)
            best = {"plain": float("inf"), "spec": float("inf")}
            outputs = {}
            stats = speculative.llm_engine.speculator.stats
            before = (stats.num_draft_tokens, stats.num_accepted_tokens)
            for _ in range(args.num_iters):
                for label, llm in (("plain", plain), ("spec", speculative)):
                    seconds, tokens = _time_one(llm, token_ids, params)
                    best[label] = min(best[label], seconds)
                    outputs[label] = tokens
            drafted = stats.num_draft_tokens - before[0]
            accepted = stats.num_accepted_tokens - before[1]
            n = len(outputs["plain"])
            plain_tokens.append(outputs["plain"])
            same = outputs["plain"] == outputs["spec"]
            if not same:
                mismatches.append(name)
            rows.append(
                {
                    "set": set_name,
                    "prompt": name,
                    "prompt_tokens": len(token_ids),
                    "output_tokens": n,
                    "plain_tok_s": n / best["plain"],
                    "spec_tok_s": len(outputs["spec"]) / best["spec"],
                    "speedup": (len(outputs["spec"]) / best["spec"]) / (n / best["plain"]),
                    "accept_rate": accepted / drafted if drafted else 0.0,
                    "identical": same,
                }
            )
            print(format_table(rows[-1:]), flush=True)
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config["int8_activations"] = engine_args.int8_activations  # the mode both engines ran in
    config["speculative_config"] = spec
    max_model_len = plain.llm_engine.max_model_len
    plain.llm_engine.shutdown()  # before llama.cpp runs, so that nothing of theirs competes with it
    speculative.llm_engine.shutdown()
    if peer is not None:
        try:
            config["llama_cpp"] = _run_llama_cpp(args, peer, spec, rows, prompt_tokens, plain_tokens, warm, threads,
                                                 max_model_len, engine_args.enable_prefix_caching)
        except llama_cpp_peer.LlamaCppPeerError as exc:
            print(exc)
            return 1
    summary = [_summary(set_name, [r for r in rows if r["set"] == set_name]) for set_name in args.sets]
    print()
    print(format_table(rows))
    print()
    print(format_table(summary))
    print(f"speculative_config: {json.dumps(spec)}; greedy, single stream, max_tokens {args.max_tokens}")
    if peer is not None:
        print(f"llama.cpp: {config['llama_cpp']['threads']} threads, {' '.join(config['llama_cpp']['spec_args'])}; "
              "spec_vs_llama_spec = pagedllm speculative / llama.cpp ngram-simple")
    if mismatches:
        print(f"OUTPUTS DIFFER with speculation on: {', '.join(mismatches)}"
              + ("" if exact else f" (int8 activations {engine_args.int8_activations}: a verified token's products may "
                 "take another way than a plain step's; exact on float32 activations, --int8-activations off)"))
    path = write_json(args.output_json, "spec", config, {"prompts": rows, "summary": summary})
    print(f"wrote {path}")
    return 1 if mismatches and exact else 0


def _run_llama_cpp(args, peer, spec: dict, rows: list[dict], prompt_tokens: list[list[int]],
                   plain_tokens: list[list[int]], warm: list[int], threads: int, max_model_len: int,
                   cache_prompt: bool) -> dict:
    """llama-server plain, then with ngram-simple, on every prompt, each for as many tokens as
    pagedllm's plain output; adds the llama columns to `rows` and returns its configuration."""
    from pagedllm.bench.datasets import BenchRequest
    from pagedllm.bench.llama_cpp_peer import LLAMA_CPP_PYTHON_VERSION, ngram_simple_args, run_single_stream

    binaries, model = peer
    spec_args = ngram_simple_args(args.llama_cpp_ngram_size_n or spec.get("prompt_lookup_max", 4),
                                  args.llama_cpp_ngram_size_m or spec.get("num_speculative_tokens", 8))
    requests = [BenchRequest(ids, len(out)) for ids, out in zip(prompt_tokens, plain_tokens)]
    runs = {}
    for label, extra in (("plain", []), ("spec", spec_args)):
        print(f"llama-server ({label}) on {model.name}, {threads} threads", flush=True)
        runs[label] = run_single_stream(binaries, model, requests, threads, max_model_len, args.num_iters, extra,
                                        cache_prompt, warm=BenchRequest(warm, 8))
    for row, expected, plain_run, spec_run in zip(rows, plain_tokens, runs["plain"], runs["spec"]):
        n = row["output_tokens"]
        row["llama_tok_s"] = n / plain_run["seconds"]
        row["llama_spec_tok_s"] = n / spec_run["seconds"]
        drafted = spec_run["draft_tokens"]
        row["llama_accept_rate"] = spec_run["accepted_tokens"] / drafted if drafted else 0.0
        row["llama_same"] = plain_run["tokens"] == expected
        row["spec_vs_llama_spec"] = row["spec_tok_s"] / row["llama_spec_tok_s"]
    return {"threads": threads, "model": str(model), "spec_args": spec_args, "cache_prompt": cache_prompt,
            "source": f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}"}


def _summary(set_name: str, rows: list[dict]) -> dict:
    """A set's rates over all its prompts (total output tokens over total best times), and the
    ratios of pagedllm's to llama.cpp's when it ran."""
    tokens = sum(r["output_tokens"] for r in rows)
    seconds = {key: sum(r["output_tokens"] / r[key] for r in rows)
               for key in ("plain_tok_s", "spec_tok_s", "llama_tok_s", "llama_spec_tok_s") if key in rows[0]}
    summary = {"set": set_name, "prompts": len(rows), "output_tokens": tokens,
               **{key: tokens / s for key, s in seconds.items()},
               "speedup": seconds["plain_tok_s"] / seconds["spec_tok_s"], "min_speedup": min(r["speedup"] for r in rows)}
    if "llama_tok_s" in seconds:
        summary["llama_speedup"] = seconds["llama_tok_s"] / seconds["llama_spec_tok_s"]
        summary["plain_vs_llama"] = seconds["llama_tok_s"] / seconds["plain_tok_s"]
        summary["spec_vs_llama_spec"] = seconds["llama_spec_tok_s"] / seconds["spec_tok_s"]
    return summary
