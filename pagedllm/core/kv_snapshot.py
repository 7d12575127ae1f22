"""A picture of the KV cache between two steps, as plain data: what the dashboard draws and
`GET /debug/kv` returns.

Built from the block manager's own tables, read only (nothing here changes the cache), by the
engine's thread between two steps, when every block table covers exactly its sequence's
computed tokens. Its cost is O(table entries + cached blocks), not O(pool): free blocks are
implied by their absence, so an idle pool of 100,000 blocks costs nothing to describe.

- Each device and CPU block that is held or kept for the prefix cache has a `BlockView`: its
  reference count (from the pool itself), the tokens it stores, whether the prefix cache
  indexes it, and the requests whose sequences hold it (more than one: a prefix-cache hit).
- Each request in the scheduler's queues has its sequences' block tables, logical to physical,
  with the tokens each block holds, and the device blocks it shares with other requests. A
  model whose layers form several KV cache groups has one table per group; a sliding-window
  group's entries for blocks that left the window are None (the block went back to the pool).
- Copy-on-write events since the previous snapshot (the block manager keeps the recent ones).
- `aggregate_cells` folds a pool into at most `max_cells` cells of consecutive blocks, so a page
  draws a large pool at the same cost as a small one.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter

from pagedllm.core.sequence import SequenceGroup

# The most cells a page is sent per pool: larger pools fold consecutive blocks into one cell.
DEFAULT_MAX_CELLS = 4096


@dataclass(slots=True)
class BlockView:
    """One physical block that is held by some sequence or kept for the prefix cache."""

    block_id: int
    ref_count: int  # block tables holding it (0: free, kept only for the prefix cache)
    num_tokens: int  # token states it stores
    cached: bool  # indexed in the prefix cache (reusable by a later prompt)
    owners: list[str] = field(default_factory=list)  # requests holding it, first holder first


@dataclass(slots=True)
class PoolView:
    """A device pool or the CPU swap pool, by columns (cheap to build for many blocks). Blocks
    in neither `ref_counts` nor `cached` are free and hold nothing."""

    num_blocks: int
    num_free_blocks: int  # unreferenced blocks, cached ones included
    block_size: int
    ref_counts: dict[int, int] = field(default_factory=dict)  # every held block -> its reference count
    owner: dict[int, str] = field(default_factory=dict)  # held block -> the first request holding it
    more_owners: dict[int, list[str]] = field(default_factory=dict)  # held by several requests: the others
    partial: dict[int, int] = field(default_factory=dict)  # held blocks not full -> tokens they hold
    cached: set[int] = field(default_factory=set)  # indexed in the prefix cache, held or not

    def block(self, block_id: int) -> BlockView | None:
        """The block's view; None when it is free and holds nothing."""
        owner = self.owner.get(block_id)
        if owner is None:
            if block_id not in self.cached:
                return None
            return BlockView(block_id, 0, self.block_size, True)
        return BlockView(
            block_id,
            self.ref_counts[block_id],
            self.partial.get(block_id, self.block_size),
            block_id in self.cached,
            [owner, *self.more_owners.get(block_id, ())],
        )

    def blocks(self) -> dict[int, BlockView]:
        """Every held or cached block's view, by id (O(blocks listed): for tests and /debug/kv)."""
        return {block_id: self.block(block_id) for block_id in sorted(self.owner.keys() | self.cached)}


@dataclass(slots=True)
class SequenceView:
    seq_id: int
    status: str  # "running", "waiting", "swapped" (a sequence status's value)
    pool: str | None  # "device", "cpu" (swapped out) or None (no blocks: waiting)
    # Its block table (KV cache group 0): logical block i -> physical block block_ids[i], None
    # where a sliding window passed and the block went back to the pool.
    block_ids: list[int | None]
    num_tokens: list[int]  # token states in each of those blocks (0 where freed)
    # The tables of KV cache groups 1, 2, ... (hybrid models), aligned with block_ids: the same
    # logical blocks hold the same tokens there, wherever the entry is not None.
    other_block_ids: list[list[int | None]] = field(default_factory=list)


@dataclass(slots=True)
class RequestView:
    request_id: str
    status: str  # the status of its unfinished sequences: "running", "waiting" or "swapped"
    seqs: list[SequenceView]
    # Other requests holding some of the same device blocks (prefix-cache hits): id -> block ids.
    shares_with: dict[str, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class KVSnapshot:
    block_size: int
    device: PoolView
    cpu: PoolView
    requests: list[RequestView]
    # (source, destination) device blocks copied on write since the previous snapshot.
    copy_on_writes: list[tuple[int, int]]
    num_copy_on_writes: int  # the block manager's total, to pass as `cow_seen` next time


@dataclass(slots=True)
class Cell:
    """`num_blocks` consecutive blocks from `first_block`, drawn as one square."""

    first_block: int
    num_blocks: int
    num_held: int = 0  # referenced by a block table
    num_cached: int = 0  # free but kept for the prefix cache
    num_shared: int = 0  # reference count above 1
    max_ref_count: int = 0
    num_tokens: int = 0  # token states stored in its blocks
    owner: str | None = None  # the request holding most of its held blocks
    copied_on_write: bool = False  # one of its blocks is a copy-on-write destination


def _fills(num_computed_tokens: int, num_blocks: int, block_size: int) -> list[int]:
    """Tokens in each block of a table covering `num_computed_tokens` (full ones first)."""
    num_full = min(num_blocks, num_computed_tokens // block_size)
    tail = [min(block_size, max(0, num_computed_tokens - i * block_size)) for i in range(num_full, num_blocks)]
    return [block_size] * num_full + tail


class _PoolBuilder:
    """Collects one pool's held blocks, request by request, with set and dict operations that
    run in C rather than a Python loop per block."""

    def __init__(self, pool, tables: dict[int, list[int]], num_blocks: int, num_free: int, block_size: int) -> None:
        self.pool = pool  # a `BlockPool`, or None (reference counts then come from the tables)
        self.tables = tables
        self.view = PoolView(num_blocks, num_free, block_size)

    def add(self, request_id: str, tables: list[list[int | None]], fills: list[list[int]]) -> None:
        view = self.view
        mine = set().union(*tables)
        mine.discard(None)
        others = view.owner.keys() & mine
        for block_id in others:  # prefix-cache hits: blocks another request holds too
            if view.owner[block_id] != request_id:
                extra = view.more_owners.setdefault(block_id, [])
                if request_id not in extra:
                    extra.append(request_id)
        view.owner.update(dict.fromkeys(mine - others, request_id))
        for table, tokens in zip(tables, fills):
            for block_id, num_tokens in zip(reversed(table), reversed(tokens)):
                if num_tokens == view.block_size or block_id is None:
                    break
                view.partial[block_id] = num_tokens

    def finish(self) -> PoolView:
        view = self.view
        held = list(view.owner)
        if self.pool is None:
            counts = Counter(b for table in self.tables.values() for b in table)
            view.ref_counts = {b: counts[b] for b in held}
        else:
            blocks = self.pool.blocks
            view.ref_counts = dict(zip(held, map(attrgetter("ref_count"), map(blocks.__getitem__, held))))
            view.cached = {block.block_id for block in self.pool.cached.values()}
        return view


def build_kv_snapshot(block_manager, groups: Iterable[SequenceGroup], cow_seen: int = 0) -> KVSnapshot:
    """The snapshot of `block_manager` (a `BlockManager`, or a reservation manager, which has
    device tables only) holding the sequences of `groups` (the scheduler's queues).
    `cow_seen` is `num_copy_on_writes` of the previous snapshot."""
    bs = block_manager.block_size
    device_pool = getattr(block_manager, "pool", None)
    cpu_pool = getattr(block_manager, "cpu_pool", None)
    device_tables = block_manager.live_tables()
    cpu_tables = block_manager.live_cpu_tables() if cpu_pool is not None else {}
    builders = {
        "device": _PoolBuilder(device_pool, device_tables, block_manager.num_total_blocks, block_manager.num_free_blocks, bs),
        "cpu": _PoolBuilder(
            cpu_pool, cpu_tables, cpu_pool.num_blocks if cpu_pool else 0, cpu_pool.num_free_blocks if cpu_pool else 0, bs
        ),
    }

    requests = []
    for group in groups:
        seqs = []
        for seq in group.unfinished_seqs():
            pool = "device" if seq.seq_id in device_tables else "cpu" if seq.seq_id in cpu_tables else None
            if pool == "device":
                tables = block_manager.block_tables(seq.seq_id)
            else:
                tables = block_manager.cpu_block_tables(seq.seq_id) if pool else [[]]
            fills = _fills(seq.num_computed_tokens, len(tables[0]), bs)
            fills = [0 if block is None else n for block, n in zip(tables[0], fills)]
            seqs.append(SequenceView(seq.seq_id, seq.status.value, pool, tables[0], fills, tables[1:]))
        for name, builder in builders.items():
            on_pool = [s for s in seqs if s.pool == name]
            if on_pool:
                tables = [t for s in on_pool for t in (s.block_ids, *s.other_block_ids)]
                fills = [s.num_tokens for s in on_pool for _ in range(1 + len(s.other_block_ids))]
                builder.add(group.request_id, tables, fills)
        requests.append(RequestView(group.request_id, seqs[0].status if seqs else "finished", seqs))

    device = builders["device"].finish()
    _link_sharers(requests, device)
    recent = list(getattr(block_manager, "recent_copy_on_writes", ()))
    total_cows = getattr(block_manager, "num_copy_on_writes", 0)
    new_cows = min(max(0, total_cows - cow_seen), len(recent))
    return KVSnapshot(
        block_size=bs,
        device=device,
        cpu=builders["cpu"].finish(),
        requests=requests,
        copy_on_writes=recent[len(recent) - new_cows :],
        num_copy_on_writes=total_cows,
    )


def _link_sharers(requests: list[RequestView], pool: PoolView) -> None:
    """Fill each request's `shares_with` from the device blocks with several owners."""
    by_id = {r.request_id: r for r in requests}
    for block_id, extra in sorted(pool.more_owners.items()):
        owners = [pool.owner[block_id], *extra]
        for owner in owners:
            request = by_id[owner]
            for other in owners:
                if other != owner:
                    request.shares_with.setdefault(other, []).append(block_id)


def aggregate_cells(pool: PoolView, max_cells: int, copied: Iterable[int] = ()) -> list[Cell]:
    """The pool as at most `max_cells` cells of equally many consecutive blocks (one block per
    cell when the pool is small enough). `copied`: copy-on-write destinations to mark.

    Counting runs over sorted block ids with bisection and `Counter`, in C, so folding 100,000
    blocks costs a few milliseconds, not a Python loop per block."""
    if max_cells < 1:
        raise ValueError(f"max_cells must be at least 1; got {max_cells}.")
    per_cell = max(1, -(-pool.num_blocks // max_cells))
    bs = pool.block_size
    held = sorted(pool.ref_counts)
    cached_free = sorted(pool.cached - pool.ref_counts.keys())
    cells = []
    for first in range(0, pool.num_blocks, per_cell):
        end = first + per_cell
        lo, hi = bisect_left(held, first), bisect_left(held, end)
        num_cached = bisect_left(cached_free, end) - bisect_left(cached_free, first)
        cell = Cell(first, min(per_cell, pool.num_blocks - first), num_held=hi - lo, num_cached=num_cached)
        cell.num_tokens = (cell.num_held + num_cached) * bs
        if lo < hi:
            cell.max_ref_count = 1
            owners = Counter(map(pool.owner.__getitem__, held[lo:hi]))
            cell.owner = owners.most_common(1)[0][0]
        cells.append(cell)
    for block_id, ref_count in pool.ref_counts.items():
        if ref_count > 1:  # shared blocks: a prompt's, a few per request
            cell = cells[block_id // per_cell]
            cell.num_shared += 1
            cell.max_ref_count = max(cell.max_ref_count, ref_count)
    for block_id, num_tokens in pool.partial.items():
        cells[block_id // per_cell].num_tokens -= bs - num_tokens
    for block_id in copied:
        if 0 <= block_id < pool.num_blocks:
            cells[block_id // per_cell].copied_on_write = True
    return cells
