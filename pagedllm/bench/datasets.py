"""Synthetic request sets with the length statistics of the paper's workloads.

ShareGPT: long and highly variable (mean input 161.31, mean output 337.99 tokens).
Alpaca: short (mean input 19.31, mean output 58.45 tokens).
Lengths are log-normal with those means, drawn from a fixed seed, and scaled down when the
model's context is shorter than the paper's 2048 tokens. Prompts are random token ids: with
`ignore_eos`, content does not change the work done.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class LengthProfile:
    mean_input: float
    mean_output: float
    sigma_input: float
    sigma_output: float


PROFILES = {
    "sharegpt": LengthProfile(161.31, 337.99, 0.9, 0.8),
    "alpaca": LengthProfile(19.31, 58.45, 0.5, 0.6),
}
PAPER_CONTEXT = 2048


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)


def sample_requests(
    dataset: str, num_requests: int, max_model_len: int, vocab_size: int, seed: int = 0,
    token_range: tuple[int, int] | None = None,
) -> list[BenchRequest]:
    if dataset not in PROFILES:
        raise ValueError(f"Unknown dataset {dataset!r}; choose one of {', '.join(PROFILES)}.")
    profile = PROFILES[dataset]
    rng = random.Random(seed)
    context = min(max_model_len, PAPER_CONTEXT)
    scale = context / PAPER_CONTEXT
    low, high = token_range or (min(100, vocab_size // 4), vocab_size - 1)
    requests = []
    for _ in range(num_requests):
        input_len = max(4, round(_lognormal(rng, profile.mean_input, profile.sigma_input) * scale))
        output_len = max(4, round(_lognormal(rng, profile.mean_output, profile.sigma_output) * scale))
        input_len = min(input_len, context // 2)
        output_len = min(output_len, context - input_len)
        prompt = [rng.randint(low, high) for _ in range(input_len)]
        requests.append(BenchRequest(prompt, output_len))
    return requests
