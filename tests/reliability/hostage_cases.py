"""The hostile requests of the hostage suite (issue 36's table, and others found since): each is
either served without stalling the other streams, or refused up front with a 400 naming the
limit it is above. Bodies are built per form: the short form (`make test`) sends smaller versions
that still go through the same mechanism (a prompt several chunks long, thousands of bad words,
a grammar of thousands of choices); the long form (`--soak`) sends the sizes of the issue."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

MODEL = "default"
# Prompt lengths: the issue's ~3,600 tokens in the long form; in the short, 2,100 where it matters
# most (more than one step's token budget of 2,048: before the step-time budget, one step computed
# 2,048 tokens and their prompt logprobs while every other stream waited ~25 s on 2 cores), and
# 1,200 (many chunks of the budget) for echo.
LONG_PROMPT = {False: 2100, True: 3600}
ECHO_PROMPT = {False: 1200, True: 3600}


def prompt_ids(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(length)]


def words(count: int, seed: int, length: tuple[int, int] = (5, 12)) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(*length))) for _ in range(count)]


@dataclass
class Case:
    name: str
    body: Callable[[bool], dict]  # long form? -> the request body (completions)
    # None: must be served (200); else the limit a 400 must name (in its message and `param`).
    refused_by: str | None = None
    param: str | None = None
    long_only: bool = False


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, **fields}


CASES = [
    Case("beam width 256", lambda long: _completion(n=256, best_of=256, use_beam_search=True, temperature=0),
         refused_by="max_beam_width", param="n"),
    Case("best_of=256 beam search", lambda long: _completion(n=1, best_of=256, use_beam_search=True, temperature=0),
         refused_by="max_beam_width", param="best_of"),
    Case("n=256 samples", lambda long: _completion(n=256, temperature=1.0, seed=1), refused_by="max_n", param="n"),
    Case("beam width 16 (the limit)", lambda long: _completion(n=16, best_of=16, use_beam_search=True, temperature=0)),
    Case("beam width 16 with 2,000 stop_token_ids", lambda long: _completion(
        n=16, best_of=16, use_beam_search=True, temperature=0, stop_token_ids=list(range(5000, 7000)))),
    Case("best_of=16 samples", lambda long: _completion(n=1, best_of=16, temperature=1.0, seed=2, logprobs=5)),
    Case("prompt_logprobs=20 on a long prompt",
         lambda long: _completion(prompt=prompt_ids(LONG_PROMPT[long], 1), prompt_logprobs=20, max_tokens=1)),
    Case("echo + logprobs=20 on a long prompt",
         lambda long: _completion(prompt=prompt_ids(ECHO_PROMPT[long], 2), echo=True, logprobs=20, max_tokens=1)),
    Case("a long prompt that fits", lambda long: _completion(prompt=prompt_ids(LONG_PROMPT[long], 3), max_tokens=4)),
    Case("bad_words of 20,000 words", lambda long: _completion(bad_words=words(20000 if long else 5000, 4), temperature=0)),
    Case("logit_bias on 40,000 tokens with best_of=16",
         lambda long: _completion(logit_bias={str(t): -1.0 for t in range(1000, 41000)}, best_of=16, temperature=1.0, seed=3)),
    Case("stop of 5,000 strings with best_of=16",
         lambda long: _completion(stop=words(5000, 5, (6, 14)), best_of=16, temperature=1.0, seed=4)),
    Case("min_tokens=max_tokens with best_of=16", lambda long: _completion(
        min_tokens=200 if long else 48, max_tokens=200 if long else 48, best_of=16, temperature=1.0, seed=5)),
    Case("a choice of 30,000 strings", lambda long: _completion(
        structured_outputs={"choice": words(30000 if long else 10000, 6)}, temperature=0)),
    Case("a choice of 100,000 strings", lambda long: _completion(structured_outputs={"choice": words(100000, 7)}, temperature=0),
         long_only=True),
    # Issue 51's cases.
    Case("a field nested 150 deep", lambda long: _completion(anything=_nested(150)), refused_by="nests more than", param="anything"),
    Case("1,000 prompts x n=16", lambda long: _completion(prompt=["Once upon a time"] * 1000, n=16, temperature=1.0),
         refused_by="--max-seqs-per-request", param="prompt"),
    Case("beam width 16 with logprobs=20 and length_penalty 1e308", lambda long: _completion(
        n=16, best_of=16, use_beam_search=True, temperature=0, logprobs=20, length_penalty=1e308)),
    Case("a grammar no string satisfies", lambda long: _completion(grammar="root ::= root root"),
         refused_by="accepts no string", param="grammar"),
    Case("seed 2**64", lambda long: _completion(seed=2**64, temperature=1.0), refused_by="[0, 2**64)", param="seed"),
]


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def heavy_grammar(index: int, long: bool) -> dict:
    """A distinct grammar of thousands of choices (tens of MiB compiled)."""
    return _completion(structured_outputs={"choice": words(30000 if long else 8000, 1000 + index)}, max_tokens=2, temperature=0)
