"""Random sequences of allocate / append / fork / free / preempt / swap against the block manager.

Besides the bookkeeping invariants (reference counts equal table references, the free queue
holds exactly the unreferenced blocks, no leaks, no double frees), a simulated KV memory checks
the meaning of it all: each block slot records which token was written there, the copies and
swaps the manager asks for are carried out on it, and reading any live sequence through its
block table must give back exactly its computed tokens.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.core import BlockManager, Sequence


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 3, 4]),
        num_blocks=st.integers(4, 24),
        num_cpu_blocks=st.integers(0, 12),
        caching=st.booleans(),
    )
    def setup(self, block_size, num_blocks, num_cpu_blocks, caching):
        self.bm = BlockManager(block_size, num_blocks, num_cpu_blocks, enable_prefix_caching=caching, watermark=0.0)
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
        """Write n more tokens of seq into its slots, as the model would."""
        table = self.bm.block_ids(seq.seq_id)
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            self.device[table[pos // self.bs]][pos % self.bs] = seq.token_ids[pos]
        seq.num_computed_tokens += n
        self.bm.commit(seq)

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

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 100))
    def admit(self, i):
        seq = self.waiting[i % len(self.waiting)]
        prefix = self.bm.find_cached_prefix(seq)
        for block, expected in zip(prefix, range(len(prefix))):
            # A hit must hold exactly this sequence's tokens.
            assert self.device[block.block_id] == seq.token_ids[expected * self.bs : (expected + 1) * self.bs]
        cached = len(prefix) * self.bs
        if prefix:
            event("prefix-cache hit")
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
        assert not set(self.bm.block_ids(child.seq_id)) & set(self.bm.block_ids(parent.seq_id))
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
    def tables_waste_at_most_one_partial_block(self):
        if not hasattr(self, "bm"):
            return
        for seq in self.running:
            assert len(self.bm.block_ids(seq.seq_id)) == -(-seq.num_computed_tokens // self.bs)
        assert set(self.bm.live_tables()) == {s.seq_id for s in self.running}
        assert set(self.bm.live_cpu_tables()) == {s.seq_id for s in self.swapped}

    @invariant()
    def every_sequence_reads_back_its_own_tokens(self):
        if not hasattr(self, "bm"):
            return
        for seq in self.running:
            table = self.bm.block_ids(seq.seq_id)
            stored = [self.device[table[p // self.bs]][p % self.bs] for p in range(seq.num_computed_tokens)]
            assert stored == seq.token_ids[: seq.num_computed_tokens]
        for seq in self.swapped:
            table = self.bm.cpu_block_ids(seq.seq_id)
            stored = [self.cpu[table[p // self.bs]][p % self.bs] for p in range(seq.num_computed_tokens)]
            assert stored == seq.token_ids[: seq.num_computed_tokens]

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
