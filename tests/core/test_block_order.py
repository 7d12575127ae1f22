"""Block ids handed to a sequence: what the free queue gives, in an order the kernel streams fast."""

from __future__ import annotations

from pagedllm.core import BlockManager, Sequence


def test_blocks_allocated_together_come_in_ascending_order_after_a_tail_first_free():
    bm = BlockManager(4, 16, 0, enable_prefix_caching=True, watermark=0.0)
    first = Sequence(0, list(range(40)))  # 10 blocks
    bm.allocate(first, 40)
    assert bm.block_ids(0) == list(range(10))
    bm.free(first)  # tail first: the free queue now ends 9, 8, ..., 0

    second = Sequence(1, [7] * 40)  # no common prefix: takes 10 fresh blocks
    bm.allocate(second, 40)
    ids = bm.block_ids(1)
    assert ids == sorted(ids) and len(set(ids)) == 10
    # The least recently freed blocks (the 6 never used, then the first chain's tail) go first.
    assert set(ids) == set(range(10, 16)) | {9, 8, 7, 6}
