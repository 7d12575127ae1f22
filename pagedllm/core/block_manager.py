"""The KV cache manager: logical-to-physical block tables, copy-on-write, swapping, prefix caching.

Each sequence sees a contiguous run of logical blocks; its block table maps them to physical
blocks anywhere in the pool. Slots are allocated one block at a time as tokens arrive, so a
sequence wastes at most its last, partly filled block.

Every mutation comes in a check-then-act pair (`blocks_needed` + `can_allocate` /
`adopt_cached_prefix` and `allocate`, `can_fork` / `fork`, `can_swap_out` / `swap_out`,
`swap_in_blocks_needed` / `swap_in`), so state never changes halfway, and each act returns what
it did. Copies and swaps to be carried out by the workers accumulate until the scheduler drains
them (`drain_pending`) into each step's control message.

Invariants (`check_invariants` verifies them):
- a device or CPU block's reference count equals the number of block tables holding it;
- the free queue holds exactly the blocks with no reference (free + referenced = total);
- a block table is append-only while its sequence runs, except for the one copy-on-write swap
  of a shared, partly filled last block;
- every block in the prefix-cache index carries the hash it is indexed under.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, deque
from collections.abc import Iterable
from typing import NamedTuple

from pagedllm.core.block_pool import BlockPool, KVBlock
from pagedllm.core.kv_breakdown import KVBreakdown
from pagedllm.core.sequence import Sequence
from pagedllm.utils import cdiv

BlockMove = tuple[int, int]  # (source block id, destination block id)
RECENT_COPY_ON_WRITES = 1024  # copy-on-writes remembered for the KV snapshot (core.kv_snapshot)


class PendingCacheOps(NamedTuple):
    """Block moves the workers must carry out before the next step's model run."""

    swap_out: list[BlockMove]  # (device block, CPU block)
    swap_in: list[BlockMove]  # (CPU block, device block)
    copies: list[BlockMove]  # (source, destination), both on the device


def hash_block(parent_hash: bytes | None, token_ids: Iterable[int]) -> bytes:
    """Content key of a full block: its parent's key chained with its own token ids, so a hit on
    block i implies the whole prefix up to block i matches."""
    digest = hashlib.sha256(parent_hash or b"root")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()[:16]


class _Table:
    __slots__ = ("blocks", "num_published")

    def __init__(self, blocks: list[KVBlock], num_published: int = 0) -> None:
        self.blocks = blocks
        self.num_published = num_published  # leading full blocks already offered to the prefix cache


def _distinct(tables: Iterable[list[KVBlock]]) -> list[KVBlock]:
    seen: dict[int, KVBlock] = {}
    for blocks in tables:
        for block in blocks:
            seen.setdefault(id(block), block)
    return list(seen.values())


class BlockManager:
    def __init__(
        self,
        block_size: int,
        num_device_blocks: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_device_blocks, enable_prefix_caching)
        self.cpu_pool = BlockPool(num_cpu_blocks, enable_caching=False)
        self.watermark_blocks = int(watermark * num_device_blocks)
        self._tables: dict[int, _Table] = {}
        self._cpu_tables: dict[int, list[KVBlock]] = {}
        self._hashes: dict[int, list[bytes]] = {}
        self._pending = PendingCacheOps([], [], [])
        # Counters for stats.
        self.num_copy_on_writes = 0
        # The latest copy-on-writes as (source, destination) blocks, for the dashboard to flash.
        self.recent_copy_on_writes: deque[BlockMove] = deque(maxlen=RECENT_COPY_ON_WRITES)
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which served from it

    # --- queries ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_pool.num_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of device blocks referenced by some sequence."""
        return 1.0 - self.pool.num_free_blocks / max(1, self.pool.num_blocks)

    def block_ids(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self._tables[seq_id].blocks]

    def cpu_block_ids(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self._cpu_tables[seq_id]]

    def has_blocks(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def ref_count(self, block_id: int) -> int:
        return self.pool.blocks[block_id].ref_count

    def live_tables(self) -> dict[int, list[int]]:
        """Every device block table, for invariant checks."""
        return {seq_id: [b.block_id for b in t.blocks] for seq_id, t in self._tables.items()}

    def live_cpu_tables(self) -> dict[int, list[int]]:
        return {seq_id: [b.block_id for b in blocks] for seq_id, blocks in self._cpu_tables.items()}

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    @property
    def usable_blocks(self) -> int:
        """Device blocks one group may ever hold: all of them less the admission watermark, so
        that a group swapped out at its largest can always come back once it is alone."""
        return self.num_total_blocks - self.watermark_blocks

    def max_blocks_held(self, prompt_len: int, num_seqs: int, max_len: int, share_prompt: bool) -> int:
        """The most device blocks a group of `num_seqs` sequences (samples or beams) grown from
        one `prompt_len`-token prompt can hold when each reaches `max_len` tokens. The KV of a
        sequence's last token is never written (the sequence ends when it is sampled). Forks
        share the prompt's full blocks; everything past them may diverge (copy on write)."""
        written = self.blocks_for_tokens(max_len - 1)
        shared = prompt_len // self.block_size if share_prompt and num_seqs > 1 else 0
        return shared + num_seqs * (written - shared)

    def slot_breakdown(self, seqs: Iterable[Sequence]) -> KVBreakdown:
        """What the device's slots hold (`core.kv_breakdown`), given the live sequences on the
        device, between steps (when each table covers exactly its computed tokens). Paged
        memory reserves nothing ahead: a block in use is full of token states except for the
        unfilled tail of a last block (counted once when shared). O(sequences)."""
        bs = self.block_size
        tails: dict[int, int] = {}
        for seq in seqs:
            table = self._tables.get(seq.seq_id)
            if table is None or not table.blocks:
                continue
            filled = seq.num_computed_tokens - (len(table.blocks) - 1) * bs
            tails[table.blocks[-1].block_id] = bs - min(max(filled, 0), bs)
        used = (self.pool.num_blocks - self.pool.num_free_blocks) * bs
        internal = sum(tails.values())
        return KVBreakdown(
            token_states=used - internal,
            internal_fragmentation=internal,
            external_fragmentation_free=self.pool.num_blocks * bs - used,
        )

    # --- prefix cache -----------------------------------------------------------------------

    def _hashes_for(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        hashes = self._hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            hashes.append(hash_block(hashes[i - 1] if i else None, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[KVBlock]:
        """The longest run of leading full blocks of `seq` already in the prefix cache. At least
        the last token is always left to compute, since its logits are needed."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in self._hashes_for(seq, max_blocks)[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def _publish(self, seq: Sequence, table: _Table) -> None:
        """Offer the sequence's newly computed full blocks to the prefix cache."""
        num_full = min(seq.num_computed_tokens // self.block_size, len(table.blocks))
        if table.num_published >= num_full:
            return
        hashes = self._hashes_for(seq, num_full)
        for i in range(table.num_published, num_full):
            self.pool.cache(table.blocks[i], hashes[i])
        table.num_published = num_full

    # --- allocation -------------------------------------------------------------------------

    def _shared_block_to_write(self, blocks: list[KVBlock], num_computed: int) -> KVBlock | None:
        """The block the next token goes into, if other tables share it (so it is copied first)."""
        index = num_computed // self.block_size
        if index < len(blocks) and blocks[index].ref_count > 1:
            return blocks[index]
        return None

    @staticmethod
    def _num_copies(writers: Counter[KVBlock]) -> int:
        """Copies made when `count` sharers of each block write into it: one each, except that
        once all other sharers have their copies, the last writes the block in place."""
        return sum(min(count, block.ref_count - 1) for block, count in writers.items())

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, cached_prefix: list[KVBlock] | None = None) -> int:
        """Free blocks that `num_new_tokens` more tokens of `seq` would take; for a sequence
        without blocks, after adopting `cached_prefix` (from `find_cached_prefix`)."""
        return self.blocks_needed_together([(seq, num_new_tokens)], {seq.seq_id: cached_prefix or []})

    def blocks_needed_together(
        self, plan: list[tuple[Sequence, int]], cached_prefixes: dict[int, list[KVBlock]] | None = None
    ) -> int:
        """Free blocks that allocating every (sequence, new tokens) of `plan` would take, the
        sequences of one group counted together: a block they share is revived or copied only as
        often as it really will be. Sequences without blocks first adopt their cached prefix."""
        needed = 0
        revived: set[KVBlock] = set()
        writers: Counter[KVBlock] = Counter()
        for seq, num_new_tokens in plan:
            table = self._tables.get(seq.seq_id)
            if table is None:
                prefix = (cached_prefixes or {}).get(seq.seq_id) or []
                needed += self.blocks_for_tokens(len(prefix) * self.block_size + num_new_tokens) - len(prefix)
                # A cache hit on an unreferenced block takes it out of the free queue (once).
                revived.update(b for b in prefix if b.ref_count == 0)
                continue
            total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
            needed += max(0, total - len(table.blocks))
            shared = self._shared_block_to_write(table.blocks, seq.num_computed_tokens)
            if shared is not None:
                writers[shared] += 1
        return needed + len(revived) + self._num_copies(writers)

    def can_allocate(self, num_blocks: int, keep_watermark: bool = False) -> bool:
        reserve = self.watermark_blocks if keep_watermark else 0
        return self.pool.num_free_blocks - num_blocks >= reserve

    def adopt_cached_prefix(self, seq: Sequence, cached_prefix: list[KVBlock]) -> int:
        """Start the block table of a sequence that has none with `cached_prefix` (from
        `find_cached_prefix`, possibly empty), taking a reference to each block. Returns the
        number of tokens those blocks hold, which the caller marks computed."""
        if seq.seq_id in self._tables:
            raise RuntimeError(f"sequence {seq.seq_id} already has blocks; only a new or preempted one adopts a prefix")
        for block in cached_prefix:
            self.pool.share(block)
        self._tables[seq.seq_id] = _Table(list(cached_prefix), num_published=len(cached_prefix))
        num_cached = len(cached_prefix) * self.block_size
        if seq.num_computed_tokens == 0 and seq.num_output_tokens == 0:
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += num_cached
        return num_cached

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room for `num_new_tokens` more tokens of `seq`, after its computed tokens. A
        shared, partly filled block about to be written is copied first (copy-on-write)."""
        table = self._tables.get(seq.seq_id)
        if table is None:
            table = self._tables[seq.seq_id] = _Table([])
        elif self._shared_block_to_write(table.blocks, seq.num_computed_tokens) is not None:
            index = seq.num_computed_tokens // self.block_size
            old = table.blocks[index]
            new = self.pool.allocate()
            self._pending.copies.append((old.block_id, new.block_id))
            self.pool.free([old])
            table.blocks[index] = new
            self.num_copy_on_writes += 1
            self.recent_copy_on_writes.append((old.block_id, new.block_id))
        total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        if len(table.blocks) < total:
            # Blocks taken together go in ascending id order (the same blocks, the same evictions):
            # the free queue holds freed chains tail first, and the CPU attention kernel streams
            # ascending runs of blocks faster than descending or scattered ones.
            fresh = [self.pool.allocate() for _ in range(total - len(table.blocks))]
            fresh.sort(key=lambda block: block.block_id)
            table.blocks.extend(fresh)

    def commit(self, seq: Sequence) -> None:
        """After a step advanced `seq.num_computed_tokens`: publish its newly full blocks."""
        if self.enable_prefix_caching:
            self._publish(seq, self._tables[seq.seq_id])

    def can_fork(self, parent: Sequence, share: bool = True) -> bool:
        return share or self.can_allocate(len(self._tables[parent.seq_id].blocks))

    def fork(self, parent: Sequence, child: Sequence, share: bool = True) -> None:
        """`child` starts as a copy of `parent`: the same physical blocks, one more reference
        each. With `share=False` (to measure what sharing saves) every block is copied instead."""
        table = self._tables[parent.seq_id]
        if share:
            for block in table.blocks:
                self.pool.share(block)
            self._tables[child.seq_id] = _Table(list(table.blocks), table.num_published)
        else:
            copies = [self.pool.allocate() for _ in table.blocks]
            self._pending.copies.extend((old.block_id, new.block_id) for old, new in zip(table.blocks, copies))
            self._tables[child.seq_id] = _Table(copies, table.num_published)
        if parent.seq_id in self._hashes:
            self._hashes[child.seq_id] = list(self._hashes[parent.seq_id])

    def free(self, seq: Sequence, keep_hashes: bool = False) -> None:
        """Release the sequence's device and CPU blocks, tail first (so the prefix cache evicts a
        chain's end before its beginning). `keep_hashes` keeps its block hashes for when it is
        recomputed after a preemption."""
        table = self._tables.pop(seq.seq_id, None)
        if table is not None:
            self.pool.free(reversed(table.blocks))
        cpu_blocks = self._cpu_tables.pop(seq.seq_id, None)
        if cpu_blocks is not None:
            self.cpu_pool.free(reversed(cpu_blocks))
        if not keep_hashes:
            self._hashes.pop(seq.seq_id, None)

    # --- swapping ---------------------------------------------------------------------------

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        blocks = _distinct(self._tables[s.seq_id].blocks for s in seqs)
        return len(blocks) <= self.cpu_pool.num_free_blocks

    def swap_out(self, seqs: list[Sequence]) -> int:
        """Move the sequences' blocks to CPU blocks; returns how many blocks were copied out. A
        block shared inside the group is copied once and stays shared on the CPU."""
        mapping: dict[int, KVBlock] = {}
        for seq in seqs:
            table = self._tables.pop(seq.seq_id)
            cpu_blocks = []
            for block in table.blocks:
                cpu_block = mapping.get(id(block))
                if cpu_block is None:
                    cpu_block = mapping[id(block)] = self.cpu_pool.allocate()
                    self._pending.swap_out.append((block.block_id, cpu_block.block_id))
                else:
                    self.cpu_pool.share(cpu_block)
                cpu_blocks.append(cpu_block)
            self._cpu_tables[seq.seq_id] = cpu_blocks
            self.pool.free(reversed(table.blocks))
        return len(mapping)

    def swap_in_blocks_needed(self, seqs: list[Sequence]) -> int:
        """Device blocks needed to bring the sequences back and give each room for one token
        (with the copies that writing into blocks shared inside the group takes)."""
        needed = len(_distinct(self._cpu_tables[s.seq_id] for s in seqs))
        writers: Counter[KVBlock] = Counter()
        for seq in seqs:
            cpu_blocks = self._cpu_tables[seq.seq_id]
            needed += max(0, self.blocks_for_tokens(seq.num_computed_tokens + 1) - len(cpu_blocks))
            shared = self._shared_block_to_write(cpu_blocks, seq.num_computed_tokens)
            if shared is not None:
                writers[shared] += 1
        return needed + self._num_copies(writers)

    def swap_in(self, seqs: list[Sequence]) -> int:
        """Bring the sequences' blocks back from the CPU; returns how many blocks were copied in."""
        mapping: dict[int, KVBlock] = {}
        for seq in seqs:
            cpu_blocks = self._cpu_tables.pop(seq.seq_id)
            blocks = []
            for cpu_block in cpu_blocks:
                block = mapping.get(id(cpu_block))
                if block is None:
                    block = mapping[id(cpu_block)] = self.pool.allocate()
                    self._pending.swap_in.append((cpu_block.block_id, block.block_id))
                else:
                    self.pool.share(block)
                blocks.append(block)
            self._tables[seq.seq_id] = _Table(blocks)
            self.cpu_pool.free(reversed(cpu_blocks))
        return len(mapping)

    def drain_pending(self) -> PendingCacheOps:
        """The swaps and copies asked for since the last call."""
        pending, self._pending = self._pending, PendingCacheOps([], [], [])
        return pending

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_cache()

    # --- invariants -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise `AssertionError` naming the first broken invariant (see the module docstring).
        O(blocks + table entries): for tests and the engine's debug mode, not the hot path."""
        for name, pool, tables in (
            ("device", self.pool, [t.blocks for t in self._tables.values()]),
            ("CPU", self.cpu_pool, list(self._cpu_tables.values())),
        ):
            holders = [0] * pool.num_blocks
            for blocks in tables:
                for block in blocks:
                    if pool.blocks[block.block_id] is not block:
                        raise AssertionError(f"a {name} table holds block {block.block_id} of another pool")
                    holders[block.block_id] += 1
            for block in pool.blocks:
                if block.ref_count != holders[block.block_id]:
                    raise AssertionError(
                        f"{name} block {block.block_id} has reference count {block.ref_count} "
                        f"but {holders[block.block_id]} block tables hold it"
                    )
            queued = [block.block_id for block in pool.free_queue]
            unreferenced = sorted(block.block_id for block in pool.blocks if block.ref_count == 0)
            if len(queued) != pool.num_free_blocks or sorted(queued) != unreferenced:
                raise AssertionError(
                    f"the {name} free queue holds {len(queued)} blocks but {len(unreferenced)} are unreferenced "
                    f"(free + referenced must equal the {pool.num_blocks} blocks)"
                )
            for block_hash, block in pool.cached.items():
                if block.block_hash != block_hash:
                    raise AssertionError(f"{name} block {block.block_id} is indexed under a hash it does not carry")
