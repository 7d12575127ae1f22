"""The KV cache manager: logical-to-physical block tables, copy-on-write, swapping, prefix caching,
and the freeing of blocks that left a sliding window.

Each sequence sees a contiguous run of logical blocks; its block table maps them to physical
blocks anywhere in the pool. Slots are allocated one block at a time as tokens arrive, so a
sequence wastes at most its last, partly filled block.

A model's layers form KV cache groups (`kv_spec.kv_cache_groups`: layers of one window each,
the window None for full attention), and a sequence holds one block table per group, all
covering the same positions, all drawing on the one pool (a block id means the same memory in
every group). A model whose layers all attend alike has one group. In a sliding-window group,
the blocks wholly before the window of the sequence's next token (`kv_spec`) go back to
the pool as soon as its tokens are computed (`commit`): their entries become None. So a model
whose layers all slide holds a bounded number of blocks per sequence, and one with some global
layers keeps those layers' blocks and frees the windowed layers' ones.

Every mutation comes in a check-then-act pair (`blocks_needed` + `can_allocate` /
`adopt_cached_prefix` and `allocate`, `can_fork` / `fork`, `can_swap_out` / `swap_out`,
`swap_in_blocks_needed` / `swap_in`), so state never changes halfway, and each act returns what
it did. `commit`, `rollback` and `free` only give blocks back, which cannot fail. Copies and swaps to be
carried out by the workers accumulate until the scheduler drains them (`drain_pending`) into
each step's control message.

Invariants (`check_invariants` verifies them):
- a device or CPU block's reference count equals the number of block table entries holding it;
- the free queue holds exactly the blocks with no reference (free + referenced = total);
- a sequence's tables, one per group, all have the same length; a full-attention group's
  table holds no None, and a windowed group's None entries are a leading run, exactly the
  blocks before the window of the sequence's next token;
- a block table is append-only while its sequence runs, except for the one copy-on-write swap
  of a shared, partly filled last block, for windowed tables, whose leading entries turn
  None as the window passes (and never come back), and for `rollback`, which takes back the
  trailing blocks that held only rejected proposed tokens (speculative decoding);
- every block in the prefix-cache index carries the key it is indexed under.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence as Seq
from typing import NamedTuple

from pagedllm.core.block_invariants import check_pool
from pagedllm.core.block_pool import BlockPool, KVBlock
from pagedllm.core.kv_breakdown import KVBreakdown
from pagedllm.core.prefix_cache import CachedPrefix, find_hit, group_key, hash_block
from pagedllm.core.sequence import Sequence
from pagedllm.kv_spec import first_block_in_window, max_blocks_of_sequence
from pagedllm.utils import cdiv

__all__ = ["BlockManager", "BlockMove", "CachedPrefix", "PendingCacheOps", "hash_block"]

BlockMove = tuple[int, int]  # (source block id, destination block id)
RECENT_COPY_ON_WRITES = 1024  # copy-on-writes remembered for the KV snapshot (core.kv_snapshot)
Table = list[KVBlock | None]  # one group's block table; None: left the window, back in the pool


class PendingCacheOps(NamedTuple):
    """Block moves the workers must carry out before the next step's model run."""

    swap_out: list[BlockMove]  # (device block, CPU block)
    swap_in: list[BlockMove]  # (CPU block, device block)
    copies: list[BlockMove]  # (source, destination), both on the device


class _Tables:
    """A sequence's device block tables, one per KV cache group."""

    __slots__ = ("groups", "num_published", "num_trimmed_for")

    def __init__(self, groups: list[Table], num_published: int = 0, num_trimmed_for: int = 0) -> None:
        self.groups = groups
        self.num_published = num_published  # leading full blocks already offered to the prefix cache
        # The sequence's computed tokens when its windowed tables were last trimmed (adoption,
        # commit): what `check_invariants` holds their freed entries against.
        self.num_trimmed_for = num_trimmed_for


def _distinct(tables: Iterable[Table]) -> list[KVBlock]:
    seen: dict[int, KVBlock] = {}
    for blocks in tables:
        for block in blocks:
            if block is not None:
                seen.setdefault(id(block), block)
    return list(seen.values())


def _ids(table: Table) -> list[int | None]:
    """The table's block ids (None where freed: always a leading run, so it is cut off first)."""
    if table and table[0] is None:
        freed = table.count(None)
        return [None] * freed + [b.block_id for b in table[freed:]]
    return [b.block_id for b in table]


class BlockManager:
    def __init__(
        self,
        block_size: int,
        num_device_blocks: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        group_windows: Seq[int | None] = (None,),
    ) -> None:
        """`group_windows`: one entry per KV cache group (`kv_spec.kv_cache_groups`), its
        sliding window in tokens or None for full attention."""
        if not group_windows:
            raise ValueError("group_windows needs one entry per KV cache group (at least one)")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        self._windowed = [(g, w) for g, w in enumerate(self.group_windows) if w is not None]
        self.pool = BlockPool(num_device_blocks, enable_prefix_caching)
        self.cpu_pool = BlockPool(num_cpu_blocks, enable_caching=False)
        self.watermark_blocks = int(watermark * num_device_blocks)
        self._tables: dict[int, _Tables] = {}
        self._cpu_tables: dict[int, list[Table]] = {}
        self._hashes: dict[int, list[bytes]] = {}
        self._pending = PendingCacheOps([], [], [])
        # Counters for stats.
        self.num_copy_on_writes = 0
        self.num_window_frees = 0  # blocks given back because they left a sliding window
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

    def block_ids(self, seq_id: int, group: int = 0) -> list[int | None]:
        """The sequence's block table in KV cache group `group` (None: left the window)."""
        return _ids(self._tables[seq_id].groups[group])

    def block_tables(self, seq_id: int) -> list[list[int | None]]:
        """The sequence's block tables, one per KV cache group."""
        groups = self._tables[seq_id].groups
        return [_ids(groups[0])] if len(groups) == 1 else [_ids(table) for table in groups]

    def cpu_block_ids(self, seq_id: int, group: int = 0) -> list[int | None]:
        return _ids(self._cpu_tables[seq_id][group])

    def cpu_block_tables(self, seq_id: int) -> list[list[int | None]]:
        return [_ids(table) for table in self._cpu_tables[seq_id]]

    def has_blocks(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def num_blocks_held(self, seq_id: int) -> int:
        """Device block references the sequence's tables hold, all groups."""
        return sum(len(table) - table.count(None) for table in self._tables[seq_id].groups)

    def ref_count(self, block_id: int) -> int:
        return self.pool.blocks[block_id].ref_count

    def live_tables(self) -> dict[int, list[int]]:
        """Every sequence's device blocks, all groups (None entries left out), for invariant checks."""
        return {seq_id: [b.block_id for table in t.groups for b in table if b is not None] for seq_id, t in self._tables.items()}

    def live_cpu_tables(self) -> dict[int, list[int]]:
        return {seq_id: [b.block_id for table in groups for b in table if b is not None] for seq_id, groups in self._cpu_tables.items()}

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    @property
    def usable_blocks(self) -> int:
        """Device blocks one group may ever hold: all of them less the admission watermark, so
        that a group swapped out at its largest can always come back once it is alone."""
        return self.num_total_blocks - self.watermark_blocks

    def max_blocks_of_sequence(self, num_tokens: int, max_chunk: int | None = None) -> int:
        """The most device blocks one sequence holds, all groups, while its first `num_tokens`
        tokens are computed in steps of at most `max_chunk` tokens (`kv_spec`)."""
        return max_blocks_of_sequence(self.group_windows, num_tokens, self.block_size, max_chunk)

    def max_blocks_held(
        self, prompt_len: int, num_seqs: int, max_len: int, share_prompt: bool, max_chunk: int | None = None
    ) -> int:
        """The most device blocks a group of `num_seqs` sequences (samples or beams) grown from
        one `prompt_len`-token prompt can hold when each reaches `max_len` tokens, its tokens
        computed in steps of at most `max_chunk` (the scheduler's token budget; None: any). The
        KV of a sequence's last token is never written (the sequence ends when it is sampled).
        Forks share the prompt's full blocks; everything past them may diverge (copy on write).
        A windowed group holds at most its window's blocks per sequence (or that much less)."""
        written = self.blocks_for_tokens(max_len - 1)
        shared = prompt_len // self.block_size if share_prompt and num_seqs > 1 else 0
        full = shared + num_seqs * (written - shared)
        total = 0
        for window in self.group_windows:
            if window is None:
                total += full
            else:
                one = max_blocks_of_sequence((window,), max_len - 1, self.block_size, max_chunk)
                total += min(full, num_seqs * one)
        return total

    def slot_breakdown(self, seqs: Iterable[Sequence]) -> KVBreakdown:
        """What the device's slots hold (`core.kv_breakdown`), given the live sequences on the
        device, between steps (when each table covers exactly its computed tokens). Paged
        memory reserves nothing ahead: a block in use is full of token states except for the
        unfilled tail of a last block (counted once when shared). O(sequences)."""
        bs = self.block_size
        tails: dict[int, int] = {}
        for seq in seqs:
            tables = self._tables.get(seq.seq_id)
            if tables is None or not tables.groups[0]:
                continue
            filled = seq.num_computed_tokens - (len(tables.groups[0]) - 1) * bs
            for table in tables.groups:
                if table[-1] is not None:  # (a window of one token may have freed even the last block)
                    tails[table[-1].block_id] = bs - min(max(filled, 0), bs)
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

    def find_cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """The longest run of leading full blocks of `seq` already in the prefix cache, as every
        group needs them (`core.prefix_cache`). At least the last token is always left to
        compute, since its logits are needed."""
        if not self.enable_prefix_caching:
            return CachedPrefix.empty(self.num_groups)
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._hashes_for(seq, max_blocks)[:max_blocks]
        return find_hit(hashes, self.group_windows, self.block_size, self.pool.lookup)

    def _as_prefix(self, cached_prefix: CachedPrefix | list[KVBlock] | None) -> CachedPrefix:
        """A `CachedPrefix`, from one or from a one-group manager's list of blocks."""
        if isinstance(cached_prefix, CachedPrefix):
            return cached_prefix
        if not cached_prefix:
            return CachedPrefix.empty(self.num_groups)
        if self.num_groups != 1:
            raise ValueError("a cached prefix of several KV cache groups comes from find_cached_prefix, not a list")
        return CachedPrefix((tuple(cached_prefix),))

    def _publish(self, seq: Sequence, tables: _Tables) -> None:
        """Offer the sequence's newly computed full blocks to the prefix cache."""
        # (Accepted proposed tokens are computed a moment before they join `seq.token_ids`.)
        num_full = min(min(seq.num_computed_tokens, seq.num_tokens) // self.block_size, len(tables.groups[0]))
        if tables.num_published >= num_full:
            return
        hashes = self._hashes_for(seq, num_full)
        for group, table in enumerate(tables.groups):
            for i in range(tables.num_published, num_full):
                if table[i] is not None:
                    self.pool.cache(table[i], group_key(hashes[i], group))
        tables.num_published = num_full

    # --- allocation -------------------------------------------------------------------------

    def _shared_block_to_write(self, blocks: Table, num_computed: int) -> KVBlock | None:
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

    def blocks_needed(
        self, seq: Sequence, num_new_tokens: int, cached_prefix: CachedPrefix | list[KVBlock] | None = None
    ) -> int:
        """Free blocks that `num_new_tokens` more tokens of `seq` would take; for a sequence
        without blocks, after adopting `cached_prefix` (from `find_cached_prefix`)."""
        return self.blocks_needed_together([(seq, num_new_tokens)], {seq.seq_id: cached_prefix})

    def blocks_needed_together(
        self, plan: list[tuple[Sequence, int]], cached_prefixes: dict[int, CachedPrefix | list[KVBlock] | None] | None = None
    ) -> int:
        """Free blocks that allocating every (sequence, new tokens) of `plan` would take, the
        sequences of one group counted together: a block they share is revived or copied only as
        often as it really will be. Sequences without blocks first adopt their cached prefix."""
        needed = 0
        revived: set[KVBlock] = set()
        writers: Counter[KVBlock] = Counter()
        for seq, num_new_tokens in plan:
            tables = self._tables.get(seq.seq_id)
            if tables is None:
                prefix = self._as_prefix((cached_prefixes or {}).get(seq.seq_id))
                held = prefix.num_blocks
                needed += self.num_groups * (self.blocks_for_tokens(held * self.block_size + num_new_tokens) - held)
                # A cache hit on an unreferenced block takes it out of the free queue (once).
                revived.update(b for b in prefix.blocks() if b.ref_count == 0)
                continue
            groups = tables.groups
            total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
            if total > len(groups[0]):
                needed += len(groups) * (total - len(groups[0]))
            for table in groups:
                shared = self._shared_block_to_write(table, seq.num_computed_tokens)
                if shared is not None:
                    writers[shared] += 1
        return needed + len(revived) + self._num_copies(writers)

    def can_allocate(self, num_blocks: int, keep_watermark: bool = False) -> bool:
        reserve = self.watermark_blocks if keep_watermark else 0
        return self.pool.num_free_blocks - num_blocks >= reserve

    def adopt_cached_prefix(self, seq: Sequence, cached_prefix: CachedPrefix | list[KVBlock]) -> int:
        """Start the block tables of a sequence that has none with `cached_prefix` (from
        `find_cached_prefix`, possibly empty), taking a reference to each block. Returns the
        number of tokens those blocks hold, which the caller marks computed."""
        if seq.seq_id in self._tables:
            raise RuntimeError(f"sequence {seq.seq_id} already has blocks; only a new or preempted one adopts a prefix")
        prefix = self._as_prefix(cached_prefix)
        for block in prefix.blocks():
            self.pool.share(block)
        num_cached = prefix.num_blocks * self.block_size
        self._tables[seq.seq_id] = _Tables([list(table) for table in prefix.tables], prefix.num_blocks, num_cached)
        if seq.num_computed_tokens == 0 and seq.num_output_tokens == 0:
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += num_cached
        return num_cached

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room for `num_new_tokens` more tokens of `seq`, after its computed tokens, in
        every group. A shared, partly filled block about to be written is copied first
        (copy-on-write)."""
        tables = self._tables.get(seq.seq_id)
        if tables is None:
            tables = self._tables[seq.seq_id] = _Tables([[] for _ in range(self.num_groups)])
        total = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        for table in tables.groups:
            if self._shared_block_to_write(table, seq.num_computed_tokens) is not None:
                index = seq.num_computed_tokens // self.block_size
                old = table[index]
                new = self.pool.allocate()
                self._pending.copies.append((old.block_id, new.block_id))
                self.pool.free([old])
                table[index] = new
                self.num_copy_on_writes += 1
                self.recent_copy_on_writes.append((old.block_id, new.block_id))
            if len(table) < total:
                # Blocks taken together go in ascending id order (the same blocks, the same evictions):
                # the free queue holds freed chains tail first, and the CPU attention kernel streams
                # ascending runs of blocks faster than descending or scattered ones.
                fresh = [self.pool.allocate() for _ in range(total - len(table))]
                fresh.sort(key=lambda block: block.block_id)
                table.extend(fresh)

    def commit(self, seq: Sequence) -> None:
        """After a step advanced `seq.num_computed_tokens`: publish its newly full blocks, then
        give back the blocks that left a windowed group's window (published first, they stay
        reusable by a prefix-cache hit until evicted)."""
        tables = self._tables[seq.seq_id]
        if self.enable_prefix_caching:
            self._publish(seq, tables)
        tables.num_trimmed_for = seq.num_computed_tokens
        for group, window in self._windowed:
            table = tables.groups[group]
            first = first_block_in_window(window, seq.num_computed_tokens, self.block_size)
            gone = []
            for i in range(first - 1, -1, -1):  # tail first, as free() does; stops at the last freed
                if table[i] is None:
                    break
                gone.append(table[i])
                table[i] = None
            if gone:
                self.pool.free(gone)
                self.num_window_frees += len(gone)

    def rollback(self, seq: Sequence, num_tokens: int) -> int:
        """Speculative decoding: the last `num_tokens` slots allocated to `seq` held proposed
        tokens the model rejected. Call after `seq.num_computed_tokens` counts only the accepted
        ones, before `commit`: each group's table is cut back to cover exactly the computed tokens,
        and the blocks that held only rejected tokens are freed (tail first; never published to
        the prefix cache, since `commit` publishes only computed tokens). A rejected slot left in a
        kept block is simply overwritten by the next token. Returns the blocks freed."""
        tables = self._tables[seq.seq_id]
        keep = self.blocks_for_tokens(seq.num_computed_tokens)
        covered = len(tables.groups[0]) * self.block_size
        if num_tokens < 0 or seq.num_computed_tokens + num_tokens > covered:
            raise ValueError(
                f"cannot roll back {num_tokens} slots of sequence {seq.seq_id}: its tables cover {covered} slots "
                f"and it has {seq.num_computed_tokens} computed tokens"
            )
        freed = 0
        for table in tables.groups:
            gone = table[keep:]
            del table[keep:]
            self.pool.free(b for b in reversed(gone) if b is not None)
            freed += len(gone)
        tables.num_published = min(tables.num_published, keep)
        return freed

    def can_fork(self, parent: Sequence, share: bool = True) -> bool:
        return share or self.can_allocate(self.num_blocks_held(parent.seq_id))

    def fork(self, parent: Sequence, child: Sequence, share: bool = True) -> None:
        """`child` starts as a copy of `parent`: the same physical blocks, one more reference
        each. With `share=False` (to measure what sharing saves) every block is copied instead."""
        tables = self._tables[parent.seq_id]
        groups = []
        for table in tables.groups:
            if share:
                for block in table:
                    if block is not None:
                        self.pool.share(block)
                groups.append(list(table))
            else:
                copies: Table = [None if old is None else self.pool.allocate() for old in table]
                self._pending.copies.extend(
                    (old.block_id, new.block_id) for old, new in zip(table, copies) if old is not None
                )
                groups.append(copies)
        self._tables[child.seq_id] = _Tables(groups, tables.num_published, tables.num_trimmed_for)
        if parent.seq_id in self._hashes:
            self._hashes[child.seq_id] = list(self._hashes[parent.seq_id])

    def free(self, seq: Sequence, keep_hashes: bool = False) -> None:
        """Release the sequence's device and CPU blocks, tail first (so the prefix cache evicts a
        chain's end before its beginning). `keep_hashes` keeps its block hashes for when it is
        recomputed after a preemption."""
        tables = self._tables.pop(seq.seq_id, None)
        if tables is not None:
            for table in tables.groups:
                self.pool.free(b for b in reversed(table) if b is not None)
        cpu_tables = self._cpu_tables.pop(seq.seq_id, None)
        if cpu_tables is not None:
            for table in cpu_tables:
                self.cpu_pool.free(b for b in reversed(table) if b is not None)
        if not keep_hashes:
            self._hashes.pop(seq.seq_id, None)

    # --- swapping ---------------------------------------------------------------------------

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        blocks = _distinct(table for s in seqs for table in self._tables[s.seq_id].groups)
        return len(blocks) <= self.cpu_pool.num_free_blocks

    @staticmethod
    def _move(tables: list[Table], mapping: dict[int, KVBlock], target: BlockPool, moves: list[BlockMove]) -> list[Table]:
        """`tables` with every block replaced by its twin in `target`: allocated (and the move
        recorded) the first time a block is met, shared after that, so blocks shared inside a
        group stay shared."""
        moved = []
        for table in tables:
            twins: Table = []
            for block in table:
                if block is None:
                    twins.append(None)
                    continue
                twin = mapping.get(id(block))
                if twin is None:
                    twin = mapping[id(block)] = target.allocate()
                    moves.append((block.block_id, twin.block_id))
                else:
                    target.share(twin)
                twins.append(twin)
            moved.append(twins)
        return moved

    def swap_out(self, seqs: list[Sequence]) -> int:
        """Move the sequences' blocks to CPU blocks; returns how many blocks were copied out. A
        block shared inside the group is copied once and stays shared on the CPU."""
        mapping: dict[int, KVBlock] = {}
        for seq in seqs:
            tables = self._tables.pop(seq.seq_id)
            self._cpu_tables[seq.seq_id] = self._move(tables.groups, mapping, self.cpu_pool, self._pending.swap_out)
            for table in tables.groups:
                self.pool.free(b for b in reversed(table) if b is not None)
        return len(mapping)

    def swap_in_blocks_needed(self, seqs: list[Sequence]) -> int:
        """Device blocks needed to bring the sequences back and give each room for one token
        (with the copies that writing into blocks shared inside the group takes)."""
        needed = len(_distinct(table for s in seqs for table in self._cpu_tables[s.seq_id]))
        writers: Counter[KVBlock] = Counter()
        for seq in seqs:
            cpu_tables = self._cpu_tables[seq.seq_id]
            needed += self.num_groups * max(0, self.blocks_for_tokens(seq.num_computed_tokens + 1) - len(cpu_tables[0]))
            for table in cpu_tables:
                shared = self._shared_block_to_write(table, seq.num_computed_tokens)
                if shared is not None:
                    writers[shared] += 1
        return needed + self._num_copies(writers)

    def swap_in(self, seqs: list[Sequence]) -> int:
        """Bring the sequences' blocks back from the CPU; returns how many blocks were copied in."""
        mapping: dict[int, KVBlock] = {}
        for seq in seqs:
            cpu_tables = self._cpu_tables.pop(seq.seq_id)
            blocks = self._move(cpu_tables, mapping, self.pool, self._pending.swap_in)
            self._tables[seq.seq_id] = _Tables(blocks, num_trimmed_for=seq.num_computed_tokens)
            for table in cpu_tables:
                self.cpu_pool.free(b for b in reversed(table) if b is not None)
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
        for name, pool, by_seq in (
            ("device", self.pool, {seq_id: t.groups for seq_id, t in self._tables.items()}),
            ("CPU", self.cpu_pool, self._cpu_tables),
        ):
            for seq_id, tables in by_seq.items():
                self._check_shape(name, seq_id, tables)
            check_pool(name, pool, [table for tables in by_seq.values() for table in tables])
        for seq_id, tables in self._tables.items():
            for window, table in zip(self.group_windows, tables.groups):
                first = first_block_in_window(window, tables.num_trimmed_for, self.block_size)
                if table.count(None) != min(first, len(table)):
                    raise AssertionError(
                        f"sequence {seq_id}'s table of a window of {window} frees {table.count(None)} blocks, but "
                        f"{first} have left the window of its {tables.num_trimmed_for} computed tokens"
                    )

    def _check_shape(self, name: str, seq_id: int, tables: list[Table]) -> None:
        if len(tables) != self.num_groups or len({len(table) for table in tables}) > 1:
            raise AssertionError(
                f"sequence {seq_id}'s {name} tables do not cover the same positions in each of the {self.num_groups} groups"
            )
        for window, table in zip(self.group_windows, tables):
            freed = table.count(None)
            if window is None and freed:
                raise AssertionError(f"sequence {seq_id}'s {name} table of a full-attention group has freed entries")
            if any(block is None for block in table[freed:]):
                raise AssertionError(
                    f"sequence {seq_id}'s {name} table of a window of {window} frees entries other than a leading run"
                )
