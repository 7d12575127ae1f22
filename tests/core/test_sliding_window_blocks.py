"""Sliding-window groups in the block manager, case by case: which blocks leave the window,
what a prefix-cache hit needs of a windowed group, and the bound admission uses."""

from __future__ import annotations

from pagedllm.core import BlockManager, Sequence
from pagedllm.kv_spec import max_blocks_of_sequence, max_blocks_spanned

BS, WINDOW = 2, 5  # a query sees itself and the 4 positions before it: two blocks back


def _run(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    seq.num_computed_tokens = bm.adopt_cached_prefix(seq, bm.find_cached_prefix(seq))
    bm.allocate(seq, num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = num_tokens
    bm.commit(seq)


def test_blocks_wholly_before_the_next_tokens_window_go_back_to_the_pool():
    bm = BlockManager(BS, 8, group_windows=(WINDOW,), watermark=0.0)
    seq = Sequence(0, list(range(12)))
    _run(bm, seq, 12)
    # The next token, at position 12, sees positions 8..12: blocks 4 and 5 (and its own, 6).
    assert bm.block_ids(0) == [None, None, None, None, 4, 5]
    assert bm.num_free_blocks == 6 and bm.num_window_frees == 4
    seq.append_token(12, 0.0)
    bm.allocate(seq, 1)
    seq.num_computed_tokens += 1
    bm.commit(seq)
    assert bm.block_ids(0) == [None] * 4 + [4, 5, 6]  # position 13 sees 9..13: block 4 stays
    bm.check_invariants()


def test_a_hybrid_keeps_every_full_attention_block_and_frees_the_windowed_ones():
    bm = BlockManager(BS, 16, group_windows=(None, WINDOW), watermark=0.0)
    seq = Sequence(0, list(range(12)))
    _run(bm, seq, 12)
    full, windowed = bm.block_tables(0)
    assert None not in full and len(full) == 6
    assert windowed[:4] == [None] * 4 and None not in windowed[4:]
    assert bm.num_blocks_held(0) == 6 + 2
    bm.check_invariants()


def _evict(bm: BlockManager, count: int, seq_id: int) -> Sequence:
    """A sequence that takes the `count` blocks at the front of the free queue (spread over its
    groups' tables)."""
    tokens = count // bm.num_groups * BS
    other = Sequence(seq_id, [100 + seq_id] * tokens)
    bm.allocate(other, tokens)
    return other


def test_a_windowed_hit_needs_only_the_blocks_the_first_recomputed_token_sees():
    bm = BlockManager(BS, 6, group_windows=(WINDOW,), watermark=0.0)
    first = Sequence(0, list(range(12)))
    _run(bm, first, 12)
    bm.free(first)  # the free queue: 3, 2, 1, 0 (left the window), then 5, 4 (freed tail first)
    again = Sequence(1, list(range(12)) + [7, 7, 7])
    hit = bm.find_cached_prefix(again)
    assert len(hit) == 6 and hit.tables[0][:4] == (None,) * 4
    _evict(bm, 4, seq_id=2)  # blocks 0..3 get new contents: the window never needed them
    hit = bm.find_cached_prefix(again)
    assert [None if b is None else b.block_id for b in hit] == [None] * 4 + [4, 5]
    assert bm.blocks_needed(again, 3, hit) == 2 + 2  # two blocks revived from the free queue, two new
    assert bm.adopt_cached_prefix(again, hit) == 12
    bm.check_invariants()


def test_a_hit_stops_where_a_block_inside_the_window_was_evicted():
    bm = BlockManager(BS, 6, group_windows=(WINDOW,), watermark=0.0)
    first = Sequence(0, list(range(12)))
    _run(bm, first, 12)
    bm.free(first)
    _evict(bm, 5, seq_id=2)  # 0..3, then 5: only block 4 (positions 8, 9) keeps its tokens
    # A hit of 6 or 5 blocks would need block 5 or block 3; of 4 .. 1 blocks, blocks before 4.
    assert len(bm.find_cached_prefix(Sequence(1, list(range(12)) + [7]))) == 0


def test_in_a_hybrid_the_full_group_needs_the_whole_prefix():
    bm = BlockManager(BS, 12, group_windows=(None, WINDOW), watermark=0.0)
    first = Sequence(0, list(range(12)))
    _run(bm, first, 12)
    bm.free(first)
    again = Sequence(1, list(range(12)) + [7])
    hit = bm.find_cached_prefix(again)
    assert len(hit) == 6 and None not in hit.tables[0] and hit.tables[1][:4] == (None,) * 4
    # Blocks 0..3 of the windowed group left its window first, so they are evicted first; the
    # full group's blocks are all still cached: the hit keeps its length.
    _evict(bm, 4, seq_id=2)
    assert len(bm.find_cached_prefix(again)) == 6
    bm.check_invariants()


def test_a_windowed_sequence_holds_a_bounded_number_of_blocks_however_long():
    # A decode step sees W - 1 positions back plus its own; a prompt chunk of n tokens, W - 1 + n.
    assert max_blocks_spanned(WINDOW - 1 + 1, BS) == 3
    assert max_blocks_of_sequence((WINDOW,), 10_000, BS, max_chunk=1) == 3
    assert max_blocks_of_sequence((WINDOW,), 10_000, BS, max_chunk=8) == 7  # 12 positions: 7 blocks at worst
    assert max_blocks_of_sequence((None, WINDOW), 10_000, BS, max_chunk=8) == 5000 + 7
    assert max_blocks_of_sequence((WINDOW,), 3, BS, max_chunk=8) == 2  # never more than the tokens take
    bm = BlockManager(BS, 8, group_windows=(WINDOW,), watermark=0.0)
    # 4 samples of up to 1000 tokens: each at most its window's 3 blocks (+4 in the prompt's chunk).
    assert bm.max_blocks_held(20, 4, 1000, share_prompt=True, max_chunk=8) == 4 * 7
    assert BlockManager(BS, 8).max_blocks_held(20, 4, 1000, share_prompt=True, max_chunk=8) == 10 + 4 * 490
