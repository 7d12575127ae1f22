"""The request traces of the paper's evaluation: lengths shaped like ShareGPT and Alpaca
(`bench.datasets`), Poisson arrivals, parallel sampling and beam search, and a shared few-shot
prefix (the translation workload of Figure 16).

Lengths are drawn once per (dataset, size, seed) and reused at every request rate, so curves
differ only in arrival times. They are drawn at the paper's scale (contexts of 2048 tokens),
then multiplied by a profile's length scale and clipped to its context.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from pagedllm.bench.datasets import PAPER_CONTEXT, sample_requests

# Random prompt ids are drawn below this (inside every vocabulary the engine loads); with
# ignore_eos and forced lengths, content does not change the work done.
MAX_TOKEN_ID = 10_000

# Figure 16: LLaMA-13B translating WMT16 English to German with 1 or 5 examples in the prompt.
PREFIX_TOKENS = {1: 80, 5: 341}
TRANSLATION_MEAN_TOKENS = 25.0  # assumed mean sentence length, in and out (the paper gives none)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival: float  # seconds after the trace starts
    prompt_token_ids: list[int]
    output_len: int  # forced with max_tokens and ignore_eos
    n: int = 1  # parallel samples
    beam_width: int = 0  # > 0: beam search of this width


def workload(
    dataset: str, num_requests: int, max_model_len: int = PAPER_CONTEXT, length_scale: float = 1.0, seed: int = 0
) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) of each request, ShareGPT- or Alpaca-shaped: lengths
    at the paper's scale times `length_scale`, the prompt at most half of `max_model_len`."""
    requests = sample_requests(dataset, num_requests, PAPER_CONTEXT, MAX_TOKEN_ID, seed=seed)
    out = []
    for r in requests:
        input_len = min(max(1, round(len(r.prompt_token_ids) * length_scale)), max_model_len // 2)
        output_len = min(max(1, round(r.output_len * length_scale)), max_model_len - input_len)
        out.append((r.prompt_token_ids[:input_len], output_len))
    return out


def prefix_workload(shots: int, num_requests: int, length_scale: float = 1.0, seed: int = 0) -> list[tuple[list[int], int]]:
    """Translation requests that all start with the same `shots`-example prefix."""
    rng = random.Random(seed)
    scale = length_scale
    prefix = [rng.randrange(100, MAX_TOKEN_ID) for _ in range(max(1, round(PREFIX_TOKENS[shots] * scale)))]
    mean = TRANSLATION_MEAN_TOKENS * scale
    requests = []
    for _ in range(num_requests):
        input_len = max(2, round(rng.lognormvariate(math.log(mean) - 0.08, 0.4)))
        output_len = max(2, round(rng.lognormvariate(math.log(mean) - 0.08, 0.4)))
        requests.append((prefix + [rng.randrange(100, MAX_TOKEN_ID) for _ in range(input_len)], output_len))
    return requests


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times of a Poisson process of `rate` requests per second."""
    rng = random.Random(seed)
    now, times = 0.0, []
    for _ in range(num_requests):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def make_trace(
    requests: list[tuple[list[int], int]], rate: float, seed: int = 0, n: int = 1, beam_width: int = 0
) -> list[TraceRequest]:
    arrivals = poisson_arrivals(len(requests), rate, seed)
    return [TraceRequest(t, prompt, out, n, beam_width) for t, (prompt, out) in zip(arrivals, requests)]
