"""What each attention layer of a model needs of the KV cache, as plain data.

The model states it (`CausalLM.kv_cache_spec()`), the worker reports it through the executor,
and the engine's KV cache manager reads it: layers with a sliding window read only their last
`sliding_window` positions, so blocks that have left the window of every layer that reads them
can go back to the pool. A leaf module: it imports nothing, so every layer may use it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """One attention layer's cache, on one tensor-parallel rank."""

    num_kv_heads: int  # KV heads this rank stores for the layer
    head_dim: int
    # A query at position p sees keys at positions p - sliding_window + 1 .. p (itself included),
    # as transformers' sliding-window masks do; None: the whole context.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens or None, not {self.sliding_window}")
