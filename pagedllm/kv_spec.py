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


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers whose caches one block table addresses (vLLM v1's KV cache groups).

    All groups draw blocks from one pool, and a block id means the same memory in every group:
    the worker keeps `layers_per_group` key (and value) tensors, and the i-th layer of each
    group uses the i-th tensor. So a sequence holds one block table per group, and a block that
    left a sliding-window group's window returns to the pool while the full-attention groups
    keep theirs. A model whose layers all attend alike has one group of all its layers (exactly
    the layout of one tensor per layer)."""

    sliding_window: int | None  # of every layer of the group; None: full attention
    layers: tuple[int, ...]  # model layer indices; the i-th uses the group's i-th tensor


def kv_cache_groups(specs: list[AttentionSpec]) -> list[KVCacheGroup]:
    """The layers of `specs` grouped by window into groups of equally many layers.

    vLLM's rule: the group size is the fewest layers of any window (every model served today has
    an n:1 pattern, Gemma 3's 5 sliding to 1 global, so the "1" is the size), or the most when
    the counts are within 25% of each other (fewer groups, little padding). A window's layers
    that do not fill their last group leave padding there: tensor slots that group never uses.
    Layers are dealt round-robin (`layers[i::n]`) so that padding, if any, spreads evenly.
    Full-attention layers come first, so group 0 is a full-attention group whenever there is one.
    """
    if not specs:
        raise ValueError("a model needs at least one attention layer")
    by_window: dict[int | None, list[int]] = {}
    for layer, spec in sorted(enumerate(specs), key=lambda item: item[1].sliding_window is not None):
        by_window.setdefault(spec.sliding_window, []).append(layer)
    counts = [len(layers) for layers in by_window.values()]
    size = max(counts) if max(counts) < 1.25 * min(counts) else min(counts)
    groups = []
    for window, layers in by_window.items():
        num_groups = -(-len(layers) // size)
        groups.extend(KVCacheGroup(window, tuple(layers[i::num_groups])) for i in range(num_groups))
    return groups


def layers_per_group(groups: list[KVCacheGroup]) -> int:
    """Tensors a block id spans: the largest group (the others pad up to it)."""
    return max(len(group.layers) for group in groups)
