"""The step-time budget: how many prompt tokens one step may compute so that it stays within
`max_step_seconds`, measured on this machine as the engine runs.

A step's time is modelled as `base + cost * prompt_tokens`: `base` is what the step costs
without prompt tokens (decoding the running streams, sampling, outputs), `cost` the time per
prompt token (projections, attention, prompt log-probabilities: whatever the chunks of this
model on this machine really cost). Both are running averages of the steps seen; the chunk
limit is what fits in the budget once `base` is paid. Until a chunk has been measured, chunks
are small (FIRST_CHUNK); the limit never falls below MIN_CHUNK, so a prompt always advances.
On a fast device the limit is soon the step's whole token budget (`max_num_batched_tokens`).
"""

from __future__ import annotations

FIRST_CHUNK = 64
MIN_CHUNK = 16
# Weight of the newest step in the running averages: recent steps count most (a prompt's later
# chunks attend to more context and cost more per token).
_ALPHA = 0.5


class StepBudget:
    def __init__(self, max_step_seconds: float | None, max_chunk: int) -> None:
        self.max_step_seconds = max_step_seconds
        self.max_chunk = max_chunk
        self.base: float | None = None  # seconds of a step without prompt tokens
        self.cost: float | None = None  # seconds per prompt token

    def observe(self, seconds: float, prompt_tokens: int) -> None:
        """A step took `seconds`, `prompt_tokens` of its tokens were prompt (prefill) tokens."""
        if prompt_tokens == 0:
            self.base = seconds if self.base is None else (1 - _ALPHA) * self.base + _ALPHA * seconds
            return
        if prompt_tokens < MIN_CHUNK:
            return  # too few to tell the per-token cost from the step's fixed cost
        observed = max(seconds - (self.base or 0.0), 0.0) / prompt_tokens
        self.cost = observed if self.cost is None else (1 - _ALPHA) * self.cost + _ALPHA * observed

    @property
    def chunk_limit(self) -> int | None:
        """The most prompt tokens the next step may compute (None: no budget)."""
        if self.max_step_seconds is None:
            return None
        if self.cost is None:
            return min(FIRST_CHUNK, self.max_chunk)
        room = self.max_step_seconds - (self.base or 0.0)
        if self.cost <= 0:
            return self.max_chunk
        return max(MIN_CHUNK, min(self.max_chunk, int(room / self.cost)))
