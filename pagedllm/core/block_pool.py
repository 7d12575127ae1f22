"""Physical KV blocks: reference counts, the free queue, and the prefix cache's hash index.

Invariants:
- A block is in the free queue exactly when its reference count is 0.
- A free block may still hold a cached prefix (it has a `block_hash`); it stays reusable by a
  cache hit until it is handed out again, which evicts it. The free queue is in eviction order:
  least recently freed first, and a sequence's blocks are freed tail first, so the end of a
  chain is evicted before its beginning.
- `num_free_blocks` counts cached-but-unreferenced blocks as free.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class KVBlock:
    """One physical block. `prev_free`/`next_free` link it into the free queue while free."""

    __slots__ = ("block_id", "ref_count", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref_count={self.ref_count}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks: O(1) pop from the front, append at the back,
    and removal from the middle (a cache hit on a free block), with no allocation."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels: no None checks in the hot paths
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise RuntimeError("no free blocks (the caller must check first)")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """All physical blocks of one device (or of the CPU swap space)."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> KVBlock:
        """A fresh block with reference count 1 (evicting its cached content, if any)."""
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1
        block.ref_count = 1
        return block

    def share(self, block: KVBlock) -> None:
        """Take one more reference to `block` (a fork, or a prefix-cache hit on a free block)."""
        if block.ref_count == 0:
            self.free_queue.remove(block)
        block.ref_count += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference to each block, in the given order; blocks reaching 0 join the free
        queue in that order (so pass a chain tail first)."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Publish a full block under its content hash. The first block published for a hash
        keeps it; duplicates stay private."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def reset_cache(self) -> int:
        """Forget every cached block that nobody references; returns how many were forgotten."""
        forgotten = 0
        for block_hash, block in list(self.cached.items()):
            if block.ref_count == 0:
                del self.cached[block_hash]
                block.block_hash = None
                forgotten += 1
        return forgotten
