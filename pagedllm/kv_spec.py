"""What each attention layer of a model needs of the KV cache, as plain data.

The model states it (`CausalLM.kv_cache_spec()`), the worker reports it through the executor,
and the engine's KV cache manager reads it: layers with a sliding window read only their last
`sliding_window` positions, so blocks that have left the window of every layer that reads them
can go back to the pool. A leaf module: it imports nothing, so every layer may use it.
"""

from __future__ import annotations

from collections.abc import Iterable
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

# --- sliding-window arithmetic of block tables -----------------------------------------------
# A layer with a window of W tokens lets the query at position p see the keys at positions
# p - W + 1 .. p. A step that computes tokens from position c on (c = the sequence's computed
# tokens) therefore reads no key before c - W + 1, and nor does any later step, since positions
# only grow: the blocks wholly before that position can go back to the pool. A step of n tokens
# reads and writes the positions max(0, c - W + 1) .. c + n - 1, so a windowed group never holds
# more blocks than that run of at most W - 1 + n positions can touch.


def first_block_in_window(window: int | None, num_computed_tokens: int, block_size: int) -> int:
    """Index of the first block that a step starting at position `num_computed_tokens` (or any
    later step) reads; the blocks before it have left the window. 0 for full attention."""
    if window is None:
        return 0
    return max(0, num_computed_tokens - window + 1) // block_size


def max_blocks_spanned(num_positions: int, block_size: int) -> int:
    """The most blocks a run of `num_positions` consecutive positions can touch (it may start
    anywhere in a block)."""
    if num_positions <= 0:
        return 0
    return (num_positions + block_size - 2) // block_size + 1


def blocks_for_window_hit(window: int, block_size: int) -> int:
    """Consecutive cached blocks a windowed group needs just before a prefix-cache hit's end: the
    first recomputed token sees the W - 1 positions before it (at least one block, so that a hit
    is always on blocks that were really computed)."""
    return max(1, -(-(window - 1) // block_size))


def max_blocks_of_sequence(
    windows: Iterable[int | None], num_tokens: int, block_size: int, max_chunk: int | None = None
) -> int:
    """The most device blocks one sequence holds, over all KV cache groups (one window each),
    while its first `num_tokens` tokens are computed in steps of at most `max_chunk` tokens
    (None: the whole run in one step)."""
    full = -(-num_tokens // block_size)
    chunk = num_tokens if max_chunk is None else min(max_chunk, num_tokens)
    return sum(full if window is None else min(full, max_blocks_spanned(window - 1 + chunk, block_size)) for window in windows)
