"""Random sequences of allocate / append / speculate (and roll back) / fork / free / preempt / swap
against the block manager.

Besides the bookkeeping invariants (reference counts equal table references, the free queue
holds exactly the unreferenced blocks, no leaks, no double frees), a simulated KV memory checks
the meaning of it all: each block slot records which token was written there (and by which KV
cache group's layers), the copies and swaps the manager asks for are carried out on it, and
reading any live sequence through its block tables must give back exactly its computed tokens:
all of them in a full-attention group, those its next token still sees in a sliding-window
group, whose other blocks must have gone back to the pool.

The manager's groups are drawn too: one full-attention group (a plain model), one sliding
window (Mistral), a full and a windowed group (a hybrid: Qwen2, Gemma), two windows of
different sizes, and a window of one token.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.core import BlockManager, Sequence
from pagedllm.kv_spec import first_block_in_window


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 3, 4]),
        num_blocks=st.integers(4, 24),
        num_cpu_blocks=st.integers(0, 12),
        caching=st.booleans(),
        windows=st.sampled_from([(None,), (None,), (3,), (6,), (None, 4), (None, 2, 2), (5, 2), (1,)]),
    )
    def setup(self, block_size, num_blocks, num_cpu_blocks, caching, windows):
        self.bm = BlockManager(
            block_size, num_blocks, num_cpu_blocks, enable_prefix_caching=caching, watermark=0.0, group_windows=windows
        )
        self.windows = windows
        self.bs = block_size
        self.device = {b: [None] * block_size for b in range(num_blocks)}
        self.cpu = {b: [None] * block_size for b in range(num_cpu_blocks)}
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.next_id = 0

    # --- the simulated workers ---------------------------------------------------------------

    def _carry_out(self):
        swap_out, swap_in, copies = self.bm.drain_pending()
        for dev, cpu in swap_out:
            self.cpu[cpu] = list(self.device[dev])
        for cpu, dev in swap_in:
            self.device[dev] = list(self.cpu[cpu])
        if copies:
            event("copy-on-write")
        if swap_out:
            event("swap out")
        if swap_in:
            event("swap in")
        for src, dst in copies:
            assert src != dst
            self.device[dst] = list(self.device[src])

    def _compute(self, seq: Sequence, n: int):
        """Write n more tokens of seq into its slots, each group's layers into its own blocks, as
        the model would; the step reads the window before its first token, which must be there."""
        start = seq.num_computed_tokens
        for group, (window, table) in enumerate(zip(self.windows, self.bm.block_tables(seq.seq_id))):
            seen = start if window is None else min(start, window - 1)
            assert self._read(self.device, table, group, start - seen, start) == seq.token_ids[start - seen : start]
            for pos in range(start, start + n):
                self.device[table[pos // self.bs]][pos % self.bs] = (group, seq.token_ids[pos])
        seq.num_computed_tokens += n
        freed = self.bm.num_window_frees
        self.bm.commit(seq)
        if self.bm.num_window_frees > freed:
            event("blocks left a window")

    def _read(self, memory, table, group, begin, end):
        """Tokens at positions [begin, end) through one group's table, as that group wrote them."""
        stored = []
        for p in range(begin, end):
            block = table[p // self.bs]
            assert block is not None, f"position {p} is read but its block was freed"
            written = memory[block][p % self.bs]
            assert written is None or written[0] == group, f"block {block} holds another group's keys"
            stored.append(None if written is None else written[1])
        return stored

    # --- rules -------------------------------------------------------------------------------

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=12))
    def add(self, tokens):
        # A small alphabet, so prompts often share prefixes (prefix-cache hits).
        self.waiting.append(Sequence(self.next_id, tokens))
        self.next_id += 1

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), keep=st.integers(1, 12), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def add_sharing_a_prefix(self, i, keep, tokens):
        """A prompt that starts like a running sequence: a likely prefix-cache hit."""
        other = self.running[i % len(self.running)]
        self.waiting.append(Sequence(self.next_id, other.token_ids[:keep] + tokens))
        self.next_id += 1

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def add_extending(self, i, tokens):
        """A prompt that repeats all of a running sequence and goes on: a long hit, past windows."""
        other = self.running[i % len(self.running)]
        self.waiting.append(Sequence(self.next_id, other.token_ids + tokens))
        self.next_id += 1

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 100))
    def admit(self, i):
        seq = self.waiting[i % len(self.waiting)]
        prefix = self.bm.find_cached_prefix(seq)
        for group, table in enumerate(prefix.tables):
            assert len(table) == len(prefix)
            for index, block in enumerate(table):
                if block is not None:  # a hit must hold exactly this sequence's tokens, from its group
                    expected = seq.token_ids[index * self.bs : (index + 1) * self.bs]
                    assert self.device[block.block_id] == [(group, t) for t in expected]
        cached = len(prefix) * self.bs
        if prefix:
            event("prefix-cache hit")
        if any(None in table for table in prefix.tables):
            event("prefix-cache hit that needs no block before the window")
        assert cached < seq.num_tokens, "at least one token is always left to compute"
        n = seq.num_tokens - cached
        free_before = self.bm.num_free_blocks
        needed = self.bm.blocks_needed(seq, n, prefix)
        if not self.bm.can_allocate(needed):
            return
        seq.num_computed_tokens = self.bm.adopt_cached_prefix(seq, prefix)
        assert seq.num_computed_tokens == cached
        self.bm.allocate(seq, n)
        assert free_before - self.bm.num_free_blocks <= needed
        self._carry_out()
        self._compute(seq, n)
        self.waiting.remove(seq)
        self.running.append(seq)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), token=st.integers(0, 2))
    def append(self, i, token):
        seq = self.running[i % len(self.running)]
        if seq.num_uncomputed_tokens == 0:
            seq.append_token(token, 0.0)
        free_before = self.bm.num_free_blocks
        needed = self.bm.blocks_needed(seq, 1)
        if not self.bm.can_allocate(needed):
            return
        self.bm.allocate(seq, 1)
        assert free_before - self.bm.num_free_blocks <= needed
        self._carry_out()
        self._compute(seq, 1)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), token=st.integers(0, 2), drafts=st.lists(st.integers(0, 2), min_size=1, max_size=7),
          accepted=st.integers(0, 7), correction=st.integers(0, 2))
    def speculate(self, i, token, drafts, accepted, correction):
        """Speculative decoding: slots for the next token and k proposed ones, all written; the
        model accepts the first `accepted` and adds its own token; the rejected slots roll back."""
        seq = self.running[i % len(self.running)]
        if seq.num_uncomputed_tokens == 0:
            seq.append_token(token, 0.0)
        if seq.num_uncomputed_tokens != 1:
            return
        accepted = min(accepted, len(drafts))
        needed = self.bm.blocks_needed(seq, 1 + len(drafts))
        if not self.bm.can_allocate(needed):
            return
        self.bm.allocate(seq, 1 + len(drafts))
        self._carry_out()
        start = seq.num_computed_tokens
        written = [seq.last_token_id, *drafts]
        for group, table in enumerate(self.bm.block_tables(seq.seq_id)):
            for pos in range(start, start + len(written)):
                self.device[table[pos // self.bs]][pos % self.bs] = (group, written[pos - start])
        free_before = self.bm.num_free_blocks
        seq.num_computed_tokens += 1 + accepted
        freed = self.bm.rollback(seq, len(drafts) - accepted)
        assert self.bm.num_free_blocks - free_before == freed
        if freed:
            event("rollback freed a block")
        self.bm.commit(seq)
        for t in drafts[:accepted]:
            seq.append_token(t, 0.0)
        seq.append_token(correction, 0.0)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def fork(self, i):
        parent = self.running[i % len(self.running)]
        child = parent.fork(self.next_id)
        self.next_id += 1
        self.bm.fork(parent, child)
        assert self.bm.block_ids(child.seq_id) == self.bm.block_ids(parent.seq_id)
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def fork_by_copying(self, i):
        """The measuring mode without sharing: the child gets copies of every block."""
        parent = self.running[i % len(self.running)]
        if not self.bm.can_fork(parent, share=False):
            return
        child = parent.fork(self.next_id)
        self.next_id += 1
        self.bm.fork(parent, child, share=False)
        assert not set(self.bm.live_tables()[child.seq_id]) & set(self.bm.live_tables()[parent.seq_id])
        self._carry_out()
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), token=st.integers(0, 2))
    def fork_and_write(self, i, token):
        """Parallel sampling: a child forks and writes its own next token at once."""
        self.fork(i)
        self.append(len(self.running) - 1, token)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        seq = self.running.pop(i % len(self.running))
        self.bm.free(seq)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def preempt_by_recompute(self, i):
        seq = self.running.pop(i % len(self.running))
        self.bm.free(seq, keep_hashes=True)
        seq.num_computed_tokens = 0
        self.waiting.append(seq)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def swap_out(self, i):
        seq = self.running[i % len(self.running)]
        if not self.bm.can_swap_out([seq]):
            return
        self.bm.swap_out([seq])
        self._carry_out()
        self.running.remove(seq)
        self.swapped.append(seq)

    @precondition(lambda self: self.swapped)
    @rule(i=st.integers(0, 100))
    def swap_in(self, i):
        seq = self.swapped[i % len(self.swapped)]
        if not self.bm.can_allocate(self.bm.swap_in_blocks_needed([seq])):
            return
        self.bm.swap_in([seq])
        self._carry_out()
        self.swapped.remove(seq)
        self.running.append(seq)

    @rule()
    def reset_prefix_cache(self):
        self.bm.reset_prefix_cache()

    # --- invariants --------------------------------------------------------------------------

    @invariant()
    def ref_counts_equal_table_references(self):
        if not hasattr(self, "bm"):
            return
        refs = [0] * self.bm.num_total_blocks
        for table in self.bm.live_tables().values():
            for b in table:
                refs[b] += 1
        assert [self.bm.ref_count(b) for b in range(self.bm.num_total_blocks)] == refs
        cpu_refs = [0] * self.bm.cpu_pool.num_blocks
        for table in self.bm.live_cpu_tables().values():
            for b in table:
                cpu_refs[b] += 1
        assert [blk.ref_count for blk in self.bm.cpu_pool.blocks] == cpu_refs

    @invariant()
    def free_queue_holds_exactly_unreferenced_blocks(self):
        if not hasattr(self, "bm"):
            return
        for pool in (self.bm.pool, self.bm.cpu_pool):
            queued = [b.block_id for b in pool.free_queue]
            assert len(queued) == len(set(queued)) == pool.num_free_blocks
            assert sorted(queued) == sorted(b.block_id for b in pool.blocks if b.ref_count == 0)

    @invariant()
    def tables_hold_exactly_the_blocks_still_read(self):
        """At most one partial block wasted per table, and in a windowed group no block that the
        window has left: those are back in the pool."""
        if not hasattr(self, "bm"):
            return
        for seqs, tables_of in ((self.running, self.bm.block_tables), (self.swapped, self.bm.cpu_block_tables)):
            for seq in seqs:
                c = seq.num_computed_tokens
                for window, table in zip(self.windows, tables_of(seq.seq_id)):
                    assert len(table) == -(-c // self.bs)
                    first = first_block_in_window(window, c, self.bs)
                    assert table[:first] == [None] * first and None not in table[first:]
        assert set(self.bm.live_tables()) == {s.seq_id for s in self.running}
        assert set(self.bm.live_cpu_tables()) == {s.seq_id for s in self.swapped}

    @invariant()
    def every_sequence_reads_back_its_own_tokens(self):
        """Every token its next step sees: all of them in a full-attention group, the window's
        last W - 1 in a windowed one (the next token itself is the window's W-th)."""
        if not hasattr(self, "bm"):
            return
        for memory, seqs, tables_of in (
            (self.device, self.running, self.bm.block_tables), (self.cpu, self.swapped, self.bm.cpu_block_tables)
        ):
            for seq in seqs:
                c = seq.num_computed_tokens
                for group, (window, table) in enumerate(zip(self.windows, tables_of(seq.seq_id))):
                    seen = c if window is None else min(c, window - 1)
                    assert self._read(memory, table, group, c - seen, c) == seq.token_ids[c - seen : c]

    @invariant()
    def the_managers_own_invariant_check_agrees(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants()

    @invariant()
    def cache_index_is_consistent(self):
        if not hasattr(self, "bm"):
            return
        pool = self.bm.pool
        for block_hash, block in pool.cached.items():
            assert block.block_hash == block_hash
        assert sum(1 for b in pool.blocks if b.block_hash is not None) == len(pool.cached)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in self.running + self.swapped:
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_total_blocks, "device blocks leaked"
        assert self.bm.cpu_pool.num_free_blocks == self.bm.cpu_pool.num_blocks, "CPU blocks leaked"


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=80, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockManager = BlockManagerMachine.TestCase
