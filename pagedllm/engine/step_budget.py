"""The step-time budget: how many prompt tokens one step may compute so that it stays within
`max_step_seconds`, measured on this machine as the engine runs.

A step's time is modelled as `base + cost * prompt_tokens + extra * logprob_tokens`: `base` is
what the step costs without prompt tokens (decoding the running streams, sampling, outputs),
`cost` the time per prompt token (projections, attention: whatever the chunks of this model on
this machine really cost), and `extra` what a prompt token whose log-probabilities were asked
for costs on top (its row of the LM head, a log-softmax and a top-k over the vocabulary: on a
262k vocabulary, several plain tokens' worth). All are running averages of the steps seen; the
chunk limit is what fits in the budget once `base` is paid, and a log-probability token is
priced `logprob_price` plain tokens. Until a chunk has been measured, chunks
are small (FIRST_CHUNK); the limit never falls below MIN_CHUNK, so a prompt always advances.
On a fast device the limit is soon the step's whole token budget (`max_num_batched_tokens`).
"""

from __future__ import annotations

FIRST_CHUNK = 64
MIN_CHUNK = 16
# Until measured, a prompt token with log-probabilities counts as this many plain ones: on the
# 262k vocabulary of Gemma 3 270M one costs ~36 ms on one thread, several plain tokens' worth,
# and a first chunk of 64 of them stalled the other streams for 2 s.
UNMEASURED_LOGPROB_PRICE = 4.0
# Weight of the newest step in the running averages: recent steps count most (a prompt's later
# chunks attend to more context and cost more per token).
_ALPHA = 0.5
# Seconds per prompt token below which the measured cost counts as none.
NEGLIGIBLE_COST = 1e-12


class StepBudget:
    def __init__(self, max_step_seconds: float | None, max_chunk: int) -> None:
        self.max_step_seconds = max_step_seconds
        self.max_chunk = max_chunk
        self.base: float | None = None  # seconds of a step without prompt tokens
        self.cost: float | None = None  # seconds per prompt token
        self.extra: float | None = None  # seconds more per prompt token with log-probabilities

    def observe(self, seconds: float, prompt_tokens: int, logprob_tokens: int = 0) -> None:
        """A step took `seconds`; `prompt_tokens` of its tokens were prompt (prefill) tokens, and
        `logprob_tokens` of those had their log-probabilities computed."""
        if prompt_tokens == 0:
            self.base = _average(self.base, seconds)
            return
        if prompt_tokens < MIN_CHUNK:
            return  # too few to tell the per-token cost from the step's fixed cost
        above_base = max(seconds - (self.base or 0.0), 0.0)
        if logprob_tokens < MIN_CHUNK or self.cost is None:
            # Without a plain cost yet, the log-probability tokens' cost counts as the plain
            # cost: an overestimate (smaller chunks) until plain chunks are seen.
            self.cost = _average(self.cost, above_base / prompt_tokens)
            if self.cost < NEGLIGIBLE_COST:
                # Chunks no slower than `base`, step after step, halve the average towards 0;
                # below a picosecond it is 0 (no limit), not a subnormal whose quotients overflow.
                self.cost = 0.0
            return
        self.extra = _average(self.extra, max(above_base - self.cost * prompt_tokens, 0.0) / logprob_tokens)

    @property
    def logprob_price(self) -> float:
        """How many plain prompt tokens of the budget one token with log-probabilities takes
        (UNMEASURED_LOGPROB_PRICE until both costs are measured)."""
        if not self.cost or self.extra is None:
            return UNMEASURED_LOGPROB_PRICE
        return 1.0 + self.extra / self.cost

    @property
    def chunk_limit(self) -> int | None:
        """The most prompt tokens the next step may compute (None: no budget)."""
        if self.max_step_seconds is None:
            return None
        if self.cost is None:
            return min(FIRST_CHUNK, self.max_chunk)
        room = self.max_step_seconds - (self.base or 0.0)
        if self.cost <= 0 or room >= self.cost * self.max_chunk:
            return self.max_chunk
        return max(MIN_CHUNK, int(room / self.cost))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - _ALPHA) * old + _ALPHA * new
