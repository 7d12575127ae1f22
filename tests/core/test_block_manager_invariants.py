"""`BlockManager.check_invariants` passes on a consistent manager and names what broke when a
reference leaks, a block is freed twice over, or a table holds a freed block."""

from __future__ import annotations

import pytest

from pagedllm.core import BlockManager, Sequence


def _manager_with_work() -> tuple[BlockManager, Sequence, Sequence]:
    bm = BlockManager(4, 16, 8, enable_prefix_caching=True, watermark=0.0)
    parent = Sequence(0, list(range(10)))
    bm.adopt_cached_prefix(parent, [])
    bm.allocate(parent, 10)
    parent.num_computed_tokens = 10
    bm.commit(parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    other = Sequence(2, [5] * 6)
    bm.allocate(other, 6)
    other.num_computed_tokens = 6
    bm.swap_out([other])
    return bm, parent, child


def test_a_consistent_manager_passes():
    bm, parent, child = _manager_with_work()
    bm.check_invariants()
    bm.free(child)
    bm.free(parent)
    bm.check_invariants()


def test_a_leaked_reference_is_caught():
    bm, parent, _ = _manager_with_work()
    leaked = bm.pool.blocks[bm.block_ids(parent.seq_id)[0]]
    bm.pool.share(leaked)  # a reference nobody holds: the block could never be freed
    with pytest.raises(AssertionError, match=f"device block {leaked.block_id} has reference count 3 but 2"):
        bm.check_invariants()


def test_a_table_holding_a_freed_block_is_caught():
    bm, parent, child = _manager_with_work()
    block = bm.pool.blocks[bm.block_ids(parent.seq_id)[-1]]
    bm.pool.free([block, block])  # both references gone, yet both tables still hold it
    with pytest.raises(AssertionError, match="has reference count 0 but 2 block tables hold it"):
        bm.check_invariants()


def test_a_leaked_cpu_block_is_caught():
    bm, _, _ = _manager_with_work()
    bm.cpu_pool.allocate()  # taken from the CPU pool, held by no table
    with pytest.raises(AssertionError, match="CPU block"):
        bm.check_invariants()
