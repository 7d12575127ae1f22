"""The KV snapshot (`core.kv_snapshot`) tells what the block manager's own tables say: the same
owners, reference counts, prefix-cache marks and copy-on-writes; and the grid's aggregation
keeps every count while folding a 100,000-block pool into a few thousand cells."""

from __future__ import annotations

import random
import time

import pytest

from pagedllm.core import BlockManager, Sequence, SequenceGroup, SequenceStatus
from pagedllm.core.kv_snapshot import PoolView, aggregate_cells, build_kv_snapshot
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def _compute(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """What a step does for `seq`: room for its next tokens, then they are in the cache."""
    bm.allocate(seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    bm.commit(seq)


def _admit(bm: BlockManager, seq: Sequence) -> None:
    seq.num_computed_tokens = bm.adopt_cached_prefix(seq, bm.find_cached_prefix(seq))
    _compute(bm, seq, seq.num_tokens - seq.num_computed_tokens)


def _group(request_id: str, seqs: list[Sequence], status: SequenceStatus) -> SequenceGroup:
    group = SequenceGroup(request_id, seqs, SamplingParams(), arrival_time=0.0)
    group.set_status(status)
    return group


def _busy_manager() -> tuple[BlockManager, list[SequenceGroup]]:
    """Parallel samples sharing a prompt (one copied on write), a second request hitting the
    first one's prefix in the cache, a swapped-out request, a finished one whose blocks stay
    cached, and a waiting one without blocks."""
    bm = BlockManager(BLOCK_SIZE, 32, 8, enable_prefix_caching=True, watermark=0.0)
    prompt = list(range(10))
    parent = Sequence(0, prompt)
    _admit(bm, parent)
    samples = [parent] + [parent.fork(i) for i in (1, 2, 3)]
    for child in samples[1:]:
        bm.fork(parent, child)
    samples[1].append_token(99, 0.0)
    _compute(bm, samples[1], 1)  # writes into the shared, partly filled last block: a copy

    hit = Sequence(4, prompt[:8] + [7, 7, 7])
    _admit(bm, hit)  # its first two blocks come from the prefix cache (parent's blocks)

    swapped = Sequence(5, [3] * 6)
    _admit(bm, swapped)
    bm.swap_out([swapped])

    done = Sequence(6, [8] * 9)
    _admit(bm, done)
    bm.free(done)  # its two full blocks stay in the prefix cache, unreferenced

    waiting = Sequence(7, [1, 2, 3])
    groups = [
        _group("samples", samples, SequenceStatus.RUNNING),
        _group("hit", [hit], SequenceStatus.RUNNING),
        _group("swapped", [swapped], SequenceStatus.SWAPPED),
        _group("waiting", [waiting], SequenceStatus.WAITING),
    ]
    bm.check_invariants()
    return bm, groups


def _owners_from_tables(tables: dict[int, list[int]], groups: list[SequenceGroup]) -> dict[int, set[str]]:
    request_of = {seq.seq_id: g.request_id for g in groups for seq in g.seqs}
    owners: dict[int, set[str]] = {}
    for seq_id, block_ids in tables.items():
        for block_id in block_ids:
            owners.setdefault(block_id, set()).add(request_of[seq_id])
    return owners


def test_device_blocks_have_the_managers_owners_reference_counts_and_cache_marks():
    bm, groups = _busy_manager()
    snapshot = build_kv_snapshot(bm, groups)
    owners = _owners_from_tables(bm.live_tables(), groups)
    cached = {b.block_id for b in bm.pool.blocks if b.block_hash is not None}
    assert set(snapshot.device.blocks()) == set(owners) | cached
    for block_id, view in snapshot.device.blocks().items():
        assert set(view.owners) == owners.get(block_id, set()), block_id
        assert view.ref_count == bm.ref_count(block_id), block_id
        assert view.cached == (block_id in cached), block_id
    assert snapshot.device.num_free_blocks == bm.num_free_blocks
    # The prompt's first full block: four samples and the prefix-cache hit.
    first = bm.block_ids(0)[0]
    assert snapshot.device.blocks()[first].ref_count == 5
    assert snapshot.device.blocks()[first].owners == ["samples", "hit"]


def test_cpu_blocks_have_the_managers_owners_and_reference_counts():
    bm, groups = _busy_manager()
    snapshot = build_kv_snapshot(bm, groups)
    owners = _owners_from_tables(bm.live_cpu_tables(), groups)
    assert set(snapshot.cpu.blocks()) == set(owners) == set(bm.cpu_block_ids(5))
    for block_id, view in snapshot.cpu.blocks().items():
        assert view.owners == ["swapped"]
        assert view.ref_count == bm.cpu_pool.blocks[block_id].ref_count == 1
    assert (snapshot.cpu.num_blocks, snapshot.cpu.num_free_blocks) == (8, bm.num_free_cpu_blocks)


def test_block_tables_and_fill_counts_follow_each_sequence():
    bm, groups = _busy_manager()
    snapshot = build_kv_snapshot(bm, groups)
    seqs = {seq.seq_id: seq for g in groups for seq in g.seqs}
    for request in snapshot.requests:
        for view in request.seqs:
            seq = seqs[view.seq_id]
            if view.pool == "device":
                assert view.block_ids == bm.block_ids(view.seq_id)
            elif view.pool == "cpu":
                assert view.block_ids == bm.cpu_block_ids(view.seq_id)
            else:
                assert view.block_ids == [] and request.status == "waiting"
            assert sum(view.num_tokens) == seq.num_computed_tokens
            assert all(0 < n <= BLOCK_SIZE for n in view.num_tokens)
    statuses = {r.request_id: r.status for r in snapshot.requests}
    assert statuses == {"samples": "running", "hit": "running", "swapped": "swapped", "waiting": "waiting"}


def test_sharing_between_requests_names_the_shared_blocks_both_ways():
    bm, groups = _busy_manager()
    snapshot = build_kv_snapshot(bm, groups)
    by_id = {r.request_id: r for r in snapshot.requests}
    shared = bm.block_ids(4)[:2]  # the prefix-cache hit's blocks
    assert by_id["hit"].shares_with == {"samples": shared}
    assert by_id["samples"].shares_with == {"hit": shared}
    assert by_id["swapped"].shares_with == {}


def test_copy_on_writes_are_those_since_the_previous_snapshot():
    bm, groups = _busy_manager()
    first = build_kv_snapshot(bm, groups)
    copied_to = bm.block_ids(1)[-1]  # sample 1 wrote into its own copy of the last block
    assert first.copy_on_writes == [(bm.block_ids(0)[-1], copied_to)]
    assert first.num_copy_on_writes == bm.num_copy_on_writes == 1
    assert build_kv_snapshot(bm, groups, cow_seen=first.num_copy_on_writes).copy_on_writes == []
    samples = groups[0].seqs
    samples[2].append_token(98, 0.0)
    _compute(bm, samples[2], 1)
    again = build_kv_snapshot(bm, groups, cow_seen=first.num_copy_on_writes)
    assert [dst for _, dst in again.copy_on_writes] == [bm.block_ids(2)[-1]]


def test_the_snapshot_changes_nothing():
    bm, groups = _busy_manager()
    before = (bm.live_tables(), bm.live_cpu_tables(), [b.ref_count for b in bm.pool.blocks], bm.num_free_blocks)
    build_kv_snapshot(bm, groups)
    assert (bm.live_tables(), bm.live_cpu_tables(), [b.ref_count for b in bm.pool.blocks], bm.num_free_blocks) == before
    bm.check_invariants()


# --- the grid's aggregation ---------------------------------------------------------------------


def test_a_small_pool_gets_one_cell_per_block():
    bm, groups = _busy_manager()
    snapshot = build_kv_snapshot(bm, groups)
    cells = aggregate_cells(snapshot.device, max_cells=64, copied=[bm.block_ids(1)[-1]])
    assert len(cells) == 32 and all(c.num_blocks == 1 for c in cells)
    for cell in cells:
        view = snapshot.device.block(cell.first_block)
        assert cell.num_held == (1 if view and view.ref_count else 0)
        assert cell.num_cached == (1 if view and not view.ref_count and view.cached else 0)
        assert cell.num_shared == (1 if view and view.ref_count > 1 else 0)
        assert cell.owner == (view.owners[0] if view and view.ref_count else None)
        assert cell.copied_on_write == (cell.first_block == bm.block_ids(1)[-1])


def _random_large_pool(num_blocks: int, seed: int = 0) -> PoolView:
    """Half the blocks listed: held by one of 50 requests (some shared, some partly filled,
    some also cached) or free but cached."""
    rng = random.Random(seed)
    pool = PoolView(num_blocks, 0, BLOCK_SIZE)
    for block_id in rng.sample(range(num_blocks), num_blocks // 2):
        ref = rng.choice([0, 1, 1, 2, 4])
        if ref == 0 or rng.random() < 0.3:
            pool.cached.add(block_id)
        if ref:
            pool.ref_counts[block_id] = ref
            pool.owner[block_id] = f"r{rng.randrange(50)}"
            if rng.random() < 0.2:
                pool.partial[block_id] = rng.randrange(1, BLOCK_SIZE)
    pool.num_free_blocks = num_blocks - len(pool.ref_counts)
    return pool


def test_a_large_pool_folds_into_at_most_max_cells_keeping_every_count():
    pool = _random_large_pool(100_000)
    start = time.perf_counter()
    cells = aggregate_cells(pool, max_cells=4096)
    seconds = time.perf_counter() - start
    assert len(cells) <= 4096
    assert sum(c.num_blocks for c in cells) == 100_000
    assert [c.first_block for c in cells] == list(range(0, 100_000, cells[0].num_blocks))
    views = list(pool.blocks().values())  # block by block, to check the fold against
    assert sum(c.num_held for c in cells) == sum(1 for b in views if b.ref_count)
    assert sum(c.num_cached for c in cells) == sum(1 for b in views if not b.ref_count and b.cached)
    assert sum(c.num_shared for c in cells) == sum(1 for b in views if b.ref_count > 1)
    assert sum(c.num_tokens for c in cells) == sum(b.num_tokens for b in views)
    for cell in cells[:200]:
        listed = (pool.block(i) for i in range(cell.first_block, cell.first_block + cell.num_blocks))
        inside = [b for b in listed if b is not None]
        assert cell.max_ref_count == max((b.ref_count for b in inside), default=0)
        held = [b.owners[0] for b in inside if b.ref_count]
        # Its owner holds the most of its blocks.
        assert (cell.owner is None) == (not held)
        if held:
            assert held.count(cell.owner) == max(held.count(o) for o in held)
    assert seconds < 5.0  # generous: it takes milliseconds; a loop per block and cell would take minutes


def test_max_cells_must_be_positive():
    with pytest.raises(ValueError, match="max_cells"):
        aggregate_cells(PoolView(4, 4, BLOCK_SIZE), max_cells=0)


def test_a_hybrid_managers_snapshot_shows_every_groups_table_and_the_freed_entries():
    """A full and a windowed group (window 5): the windowed table's entries before the window
    are None with no tokens, every group's live blocks are owned and counted, and the JSON
    carries both tables."""
    from pagedllm.engine.kv_json import snapshot_json

    bm = BlockManager(BLOCK_SIZE, 32, 8, enable_prefix_caching=True, watermark=0.0, group_windows=(None, 5))
    seq = Sequence(0, list(range(18)))
    _admit(bm, seq)  # 18 tokens: the next one sees 14..18, so blocks 0..2 of the windowed group are freed
    snapshot = build_kv_snapshot(bm, [_group("long", [seq], SequenceStatus.RUNNING)])
    (view,) = snapshot.requests[0].seqs
    full, windowed = bm.block_tables(0)
    assert view.block_ids == full and view.other_block_ids == [windowed]
    assert windowed[:3] == [None] * 3 and None not in windowed[3:]
    assert view.num_tokens == [4, 4, 4, 4, 2]
    held = {b for b in full + windowed if b is not None}
    assert set(snapshot.device.ref_counts) == held and all(snapshot.device.ref_counts[b] == 1 for b in held)
    assert snapshot.device.partial == {full[-1]: 2, windowed[-1]: 2}
    payload = snapshot_json(snapshot)["requests"][0]["seqs"][0]
    assert payload["other_block_ids"] == [windowed]
