"""Pooling requests after each step: the driver's per-chunk vectors become one per prompt.

The driver pools each chunk of a pooling request's prompt (`ScheduledSequence.pooling_type`):
the sum of the chunk's final hidden states for MEAN, its last one for LAST, the first for CLS
when the chunk starts the prompt. Here the chunks add up in the request's `PoolState`; once the
prompt is computed, MEAN divides by the prompt's length, the vector is cut to `dimensions` and
L2-normalized when asked (in that order: a Matryoshka embedding is normalized after the cut).

A chunk that starts at position 0 starts the pool afresh: a request preempted by recomputation
computes its prompt again from the start (a MEAN or CLS pool takes no cached prefix, so its
recomputation always starts there; a LAST pool keeps only its latest chunk's row anyway).

The vectors are torch tensors made by the driver; this module only calls their methods, so the
engine's front end still imports without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.pooling_params import PoolingParams, PoolingType

# The smallest norm divided by (torch.nn.functional.normalize's eps).
NORM_EPS = 1e-12


@dataclass
class PoolState:
    """One pooling request's running pool (a tensor [hidden_size], or None before any chunk) and,
    once its prompt is computed, its vector (`finish_pool`)."""

    vector: object | None = None
    result: object | None = None

    def add(self, pooling_type: PoolingType, chunk_vector: object | None, starts_prompt: bool) -> None:
        if starts_prompt:
            self.vector = None
        if chunk_vector is None:  # a CLS pool's later chunks
            return
        if pooling_type is PoolingType.MEAN and self.vector is not None:
            self.vector = self.vector + chunk_vector
        elif pooling_type is not PoolingType.CLS or self.vector is None:
            self.vector = chunk_vector  # LAST: the latest chunk's last row is the prompt's last at the end


def finish_pool(state: PoolState, params: PoolingParams, num_prompt_tokens: int):
    """The request's vector once its whole prompt is computed (a float32 tensor [dimensions or
    hidden_size]), also kept as `state.result`."""
    vector = state.vector
    if vector is None:
        raise RuntimeError("a pooling request's prompt completed without a pooled vector")
    if params.pooling_type is PoolingType.MEAN:
        vector = vector / num_prompt_tokens
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = vector / vector.norm().clamp_min(NORM_EPS)
    state.result = vector.clone()  # its own memory, not a view of the step's batch of vectors
    return state.result
