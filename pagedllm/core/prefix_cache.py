"""Prefix-cache keys and hits, per KV cache group.

A full block is keyed by its content: its parent's key chained with its own token ids, so a hit
on block i implies that the whole prefix up to block i matches. Each KV cache group holds its
own copy of a block (its own layers' keys and values), so the pool's index keys a block by
(content, group).

What counts as a hit of h blocks (the first h * block_size prompt tokens need not be computed):
- in a full-attention group, blocks 0 .. h-1 are all cached;
- in a sliding-window group of window W, only the blocks the first recomputed token still sees
  are: the last `blocks_for_window_hit(W)` before the hit's end (or all of them, for a short
  hit). The earlier ones may have been evicted since: they are left out (None) of the new
  sequence's table, exactly as if they had left its window.
The hit is the longest h that every group allows.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from pagedllm.core.block_pool import KVBlock
from pagedllm.kv_spec import blocks_for_window_hit, first_block_in_window


def hash_block(parent_hash: bytes | None, token_ids: Iterable[int]) -> bytes:
    """Content key of a full block: its parent's key chained with its own token ids, so a hit on
    block i implies the whole prefix up to block i matches."""
    digest = hashlib.sha256(parent_hash or b"root")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()[:16]


def group_key(block_hash: bytes, group: int) -> bytes:
    """The pool index key of a block of KV cache group `group` (group 0's is the content hash)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """A prompt's leading full blocks found in the prefix cache: one table per KV cache group,
    each `num_blocks` long (None where a windowed group needs no block). Iterating and `len`
    give group 0's table, as the single list of blocks a one-group manager used to return."""

    tables: tuple[tuple[KVBlock | None, ...], ...]

    @classmethod
    def empty(cls, num_groups: int) -> "CachedPrefix":
        return cls(((),) * num_groups)

    @property
    def num_blocks(self) -> int:
        return len(self.tables[0])

    def __len__(self) -> int:
        return self.num_blocks

    def __iter__(self) -> Iterator[KVBlock | None]:
        return iter(self.tables[0])

    def blocks(self) -> Iterator[KVBlock]:
        """Every block of the hit, all groups."""
        return (block for table in self.tables for block in table if block is not None)


def find_hit(
    hashes: list[bytes], windows: tuple[int | None, ...], block_size: int, lookup: Callable[[bytes], KVBlock | None]
) -> CachedPrefix:
    """The longest prefix of `hashes` (one per full block) that every group's cached blocks
    allow (see the module docstring), as a `CachedPrefix`."""
    num_hit = len(hashes)
    full_blocks: list[KVBlock] | None = None
    for group, window in enumerate(windows):
        if window is None:  # a leading run: still valid for any shorter hit
            run = []
            for block_hash in hashes[:num_hit]:
                block = lookup(group_key(block_hash, group))
                if block is None:
                    break
                run.append(block)
            num_hit = len(run)
            if group == 0:
                full_blocks = run
    windowed = [(group, window) for group, window in enumerate(windows) if window is not None]
    while windowed:  # each windowed group may shorten the hit, which the others must allow again
        before = num_hit
        for group, window in windowed:
            num_hit = _window_hit(hashes, group, blocks_for_window_hit(window, block_size), num_hit, lookup)
        if num_hit == before or len(windowed) == 1:
            break
    tables = []
    for group, window in enumerate(windows):
        if group == 0 and full_blocks is not None:
            tables.append(tuple(full_blocks[:num_hit]))
            continue
        first = first_block_in_window(window, num_hit * block_size, block_size)
        tables.append((None,) * first + tuple(lookup(group_key(h, group)) for h in hashes[first:num_hit]))
    return CachedPrefix(tuple(tables))


def _window_hit(hashes: list[bytes], group: int, needed: int, limit: int, lookup) -> int:
    """The longest hit of at most `limit` blocks whose last `needed` blocks (or all, when it is
    shorter) are cached in `group`: the top of the rightmost run of `needed` cached blocks."""
    run = 0
    for i in range(limit - 1, -1, -1):
        if lookup(group_key(hashes[i], group)) is None:
            run = 0
            continue
        run += 1
        if run >= needed:
            return i + run
    return run
