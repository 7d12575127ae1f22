"""`pagedllm bench serve`: an HTTP load generator for a running OpenAI-compatible server.

Requests arrive as a Poisson process at `--request-rate` (or all at once with `inf`), optionally
capped at `--max-concurrency` in flight, with ShareGPT- or Alpaca-shaped lengths. Each prompt is
sent as token ids with `max_tokens=output_len` and `ignore_eos`, streamed, so every request does
exactly its planned work. Reports request and token throughput, time to first token (TTFT),
time per output token after the first (TPOT), inter-token latency (ITL, the gaps between
streamed chunks), end-to-end latency, and the paper's normalized latency (the mean over
requests of latency / output length).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from pagedllm.bench.datasets import BenchRequest, sample_requests
from pagedllm.bench.progress import Progress
from pagedllm.bench.report import format_table, write_json

# Random prompt ids are drawn below this: inside every vocabulary the engine loads, and the
# content does not change the work done with ignore_eos.
MAX_PROMPT_TOKEN_ID = 10_000


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load-test a running server over HTTP (Poisson arrivals)")
    p.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="served model name (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=("sharegpt", "alpaca"), default="sharegpt")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--dataset-seed", type=int, default=0)
    p.add_argument("--output-json", default="results/bench_serve.json")
    p.set_defaults(func=run)


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def arrival_delays(num: int, rate: float, seed: int) -> list[float]:
    """Gaps between request arrivals: exponential (a Poisson process) at `rate`, 0 for inf."""
    if rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(num)]


async def sse_lines(response):
    """The lines of a server-sent event stream, split at line feeds only: httpx's `aiter_lines`
    also splits at U+2028 and other Unicode line breaks, which JSON carries unescaped inside
    strings (a token's text), cutting an event in two."""
    pending = ""
    async for text in response.aiter_text():
        pending += text
        *lines, pending = pending.split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending.removesuffix("\r")


async def send_request(client, url: str, payload: dict, prompt_len: int) -> RequestResult:
    """Stream one completion; time its first chunk and the gaps between chunks."""
    start = time.perf_counter()
    last = start
    result = RequestResult(ok=False, prompt_len=prompt_len)
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in sse_lines(response):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
        result.latency = time.perf_counter() - start
        result.ok = True
    except Exception as exc:  # a refused connection or a dropped stream counts as a failure
        result.error = repr(exc)
    return result


def _percentiles(values: list[float], scale: float = 1000.0) -> dict:
    import numpy as np

    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    array = np.asarray(values) * scale
    return {"mean": float(array.mean()), "median": float(np.median(array)), "p99": float(np.percentile(array, 99))}


def summarise(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.ok]
    num_in = sum(r.prompt_len for r in done)
    num_out = sum(r.output_len for r in done)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1]
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "input_tokens": num_in,
        "output_tokens": num_out,
        "requests_per_s": len(done) / duration,
        "output_tok_per_s": num_out / duration,
        "total_tok_per_s": (num_in + num_out) / duration,
        "ttft_ms": _percentiles([r.ttft for r in done]),
        "tpot_ms": _percentiles(tpots),
        "itl_ms": _percentiles([gap for r in done for gap in r.itls]),
        "e2e_latency_ms": _percentiles([r.latency for r in done]),
        "normalized_latency_s_per_token": (
            sum(r.latency / r.output_len for r in done if r.output_len) / max(1, sum(1 for r in done if r.output_len))
        ),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


async def report_progress(progress: Progress, results: list, total: int) -> None:
    """Say how many requests are done (and tokens streamed) every second it may (`Progress`
    keeps it to one line per 10 s), until cancelled."""
    while True:
        await asyncio.sleep(1.0)
        if len(results) < total:  # the last line is the caller's, once all are in
            tokens = sum(r.output_len for r in results if r.ok)
            progress.update(len(results), total, "requests done", f"{tokens} output tokens")


async def run_benchmark(base_url: str, model: str, requests: list[BenchRequest], args: argparse.Namespace,
                        progress: Progress | None = None) -> dict:
    import httpx

    url = base_url + "/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    delays = arrival_delays(len(requests), args.request_rate, args.seed)

    async def one(request: BenchRequest) -> RequestResult:
        payload = {
            "model": model,
            "prompt": request.prompt_token_ids,
            "max_tokens": request.output_len,
            "ignore_eos": True,
            "temperature": args.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if limit is None:
            result = await send_request(client, url, payload, len(request.prompt_token_ids))
        else:
            async with limit:
                result = await send_request(client, url, payload, len(request.prompt_token_ids))
        finished.append(result)
        return result

    finished: list[RequestResult] = []
    progress = progress or Progress("bench serve")
    progress.phase(f"sending {len(requests)} requests")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits, headers=headers) as client:
        start = time.perf_counter()
        reporter = asyncio.create_task(report_progress(progress, finished, len(requests)))
        try:
            tasks = []
            for request, delay in zip(requests, delays):
                await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(request)))
            results = await asyncio.gather(*tasks)
        finally:
            reporter.cancel()
        duration = time.perf_counter() - start
    progress.update(len(results), len(results), "requests done")
    return summarise(results, duration)


def _server_model(base_url: str, api_key: str | None) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]


def run(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    progress = Progress("bench serve")
    progress.phase(f"asking {base_url} for its model")
    card = _server_model(base_url, args.api_key)
    model = args.model or card["id"]
    max_model_len = card.get("max_model_len") or 2048
    requests = sample_requests(
        args.dataset, args.num_prompts, max_model_len, MAX_PROMPT_TOKEN_ID, seed=args.dataset_seed,
        token_range=(100, MAX_PROMPT_TOKEN_ID - 1),
    )
    print(
        f"{len(requests)} {args.dataset}-shaped requests to {base_url} ({model}) at "
        f"{args.request_rate} req/s, max concurrency {args.max_concurrency or 'none'}"
    )
    summary = asyncio.run(run_benchmark(base_url, model, requests, args, progress))
    columns = ["completed", "failed", "duration_s", "requests_per_s", "output_tok_per_s", "total_tok_per_s",
               "normalized_latency_s_per_token"]
    print(format_table([summary], columns))
    latency_rows = [{"metric": name, **summary[name]} for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms")]
    print(format_table(latency_rows, ["metric", "mean", "median", "p99"]))
    if summary["errors"]:
        print("errors:", *summary["errors"], sep="\n  ")
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}  # no secrets in results
    config["request_rate"] = str(args.request_rate)  # JSON has no infinity
    path = write_json(args.output_json, "serve", config, summary)
    print(f"wrote {path}")
    return 0 if summary["completed"] else 1
