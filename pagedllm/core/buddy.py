"""A buddy allocator over the device's KV blocks: contiguous, power-of-two-sized, aligned runs.

This is how the contiguous-reservation baselines of the paper (Orca, FasterTransformer) get
their memory: every request sequence takes one run of `2**order` blocks starting at a multiple
of `2**order`. Rounding up to a power of two wastes slots inside the run (internal
fragmentation); free runs that are too small or not buddies of each other cannot serve a large
request even when enough blocks are free in total (external fragmentation).

A pool whose size is not a power of two is split, from block 0 up, into the largest aligned
runs that fit; runs never merge past the pool's end, because the missing buddy is never free.

Allocation only splits runs, so whether a list of runs can be allocated depends only on how many
free runs there are of each order: `can_allocate` replays the allocation on those counts, and
`allocate` makes the same choices (the smallest free run that is large enough, lowest address
first), so check and act always agree.
"""

from __future__ import annotations


def order_for(num_blocks: int) -> int:
    """The smallest order whose run (`2**order` blocks) holds `num_blocks` blocks."""
    if num_blocks < 1:
        raise ValueError(f"a run holds at least one block, got {num_blocks}")
    return (num_blocks - 1).bit_length()


def _replay(counts: list[int], orders: list[int]) -> bool:
    """Allocate runs of `orders` (largest first) on free-run `counts` per order, as `allocate`
    would; whether all succeed. Changes `counts`."""
    for order in sorted(orders, reverse=True):
        source = next((j for j in range(order, len(counts)) if counts[j]), None)
        if source is None:
            return False
        counts[source] -= 1
        for j in range(order, source):  # splitting leaves one free upper half per level
            counts[j] += 1
    return True


class BuddyAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.max_order = max(0, num_blocks.bit_length() - 1)
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]  # per order: run starts
        self._allocated: dict[int, int] = {}  # run start -> order
        self.num_free_blocks = num_blocks
        start = 0
        while start < num_blocks:
            order = self.max_order
            while start % (1 << order) or start + (1 << order) > num_blocks:
                order -= 1
            self._free[order].add(start)
            start += 1 << order
        self._empty_runs = tuple(self.free_runs())

    # --- queries ---------------------------------------------------------------------------

    def free_runs(self) -> list[int]:
        """How many free runs there are of each order (index = order)."""
        return [len(runs) for runs in self._free]

    def allocated_runs(self) -> dict[int, int]:
        """Every allocated run: its first block -> its order."""
        return dict(self._allocated)

    @property
    def largest_free_run(self) -> int:
        """Blocks in the largest free run (0 when nothing is free)."""
        for order in range(self.max_order, -1, -1):
            if self._free[order]:
                return 1 << order
        return 0

    def can_allocate(self, orders: list[int]) -> bool:
        """Whether runs of all these orders can be allocated together, now."""
        return _replay(self.free_runs(), orders)

    def can_ever_allocate(self, orders: list[int]) -> bool:
        """Whether runs of all these orders fit together in the empty pool."""
        return _replay(list(self._empty_runs), orders)

    # --- acts ------------------------------------------------------------------------------

    def allocate(self, order: int) -> int:
        """Take a free run of `2**order` blocks; returns its first block (check first)."""
        source = next((j for j in range(order, len(self._free)) if self._free[j]), None)
        if source is None:
            raise RuntimeError(f"no free run of {1 << order} blocks (the caller must check first)")
        start = min(self._free[source])
        self._free[source].remove(start)
        for j in range(source - 1, order - 1, -1):  # split: keep the lower half, free the upper
            self._free[j].add(start + (1 << j))
        self._allocated[start] = order
        self.num_free_blocks -= 1 << order
        return start

    def free(self, start: int) -> None:
        """Give back the run starting at `start`, merging it with its free buddies."""
        order = self._allocated.pop(start, None)
        if order is None:
            raise RuntimeError(f"block {start} does not start an allocated run (double free?)")
        self.num_free_blocks += 1 << order
        while order < self.max_order:
            buddy = start ^ (1 << order)
            if buddy not in self._free[order]:
                break
            self._free[order].remove(buddy)
            start = min(start, buddy)
            order += 1
        self._free[order].add(start)

    def check_invariants(self) -> None:
        """Raise `AssertionError` if free and allocated runs overlap, leave gaps, or are
        misaligned. O(blocks): for tests."""
        owner = [None] * self.num_blocks
        runs = [(s, o, "allocated") for s, o in self._allocated.items()]
        runs += [(s, o, "free") for o, starts in enumerate(self._free) for s in starts]
        for start, order, kind in runs:
            size = 1 << order
            if start % size or start + size > self.num_blocks:
                raise AssertionError(f"{kind} run at {start} of {size} blocks is misaligned or past the pool")
            for block in range(start, start + size):
                if owner[block] is not None:
                    raise AssertionError(f"block {block} is in two runs")
                owner[block] = kind
        if None in owner:
            raise AssertionError(f"block {owner.index(None)} is in no run")
        free = sum(1 << o for o, starts in enumerate(self._free) for _ in starts)
        if free != self.num_free_blocks:
            raise AssertionError(f"{free} blocks in free runs but num_free_blocks says {self.num_free_blocks}")
