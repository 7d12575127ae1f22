"""Sliding-window arithmetic of block tables: which blocks a step still reads, and how many
blocks a sequence can hold at most.

A layer with a window of W tokens lets the query at position p see the keys at positions
p - W + 1 .. p. A step that computes tokens from position c on (c = the sequence's computed
tokens) therefore reads no key before c - W + 1, and nor does any later step, since positions
only grow: the blocks wholly before that position can go back to the pool. A step of n tokens
reads and writes the positions max(0, c - W + 1) .. c + n - 1, so a windowed group never holds
more blocks than that run of at most W - 1 + n positions can touch.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.utils import cdiv


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
    return max(1, cdiv(window - 1, block_size))


def max_blocks_of_sequence(
    windows: Iterable[int | None], num_tokens: int, block_size: int, max_chunk: int | None = None
) -> int:
    """The most device blocks one sequence holds, over all KV cache groups (one window each),
    while its first `num_tokens` tokens are computed in steps of at most `max_chunk` tokens
    (None: the whole run in one step)."""
    full = cdiv(num_tokens, block_size)
    chunk = num_tokens if max_chunk is None else min(max_chunk, num_tokens)
    return sum(full if window is None else min(full, max_blocks_spanned(window - 1 + chunk, block_size)) for window in windows)
