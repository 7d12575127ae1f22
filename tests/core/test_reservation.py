"""The paper's baselines as memory policies of the core: the buddy allocator, Orca's reservations
(Oracle, Pow2, Max) and static batching, driven through the real scheduler and output
processor without a model."""

from __future__ import annotations

import pytest

from pagedllm.core import KVPolicy, ReservationBlockManager, ReservationScheduler
from pagedllm.core.buddy import BuddyAllocator, order_for
from pagedllm.core.reservation import reserved_tokens
from tests.core.policy_harness import PolicyHarness


# --- the buddy allocator --------------------------------------------------------------------------


def test_runs_are_powers_of_two_aligned_to_their_size():
    buddy = BuddyAllocator(64)
    starts = {order: buddy.allocate(order) for order in (0, 3, 2, 5, 1)}
    for order, start in starts.items():
        assert start % (1 << order) == 0
    buddy.check_invariants()
    assert buddy.num_free_blocks == 64 - sum(1 << o for o in starts)


def test_a_pool_not_a_power_of_two_splits_into_aligned_runs_that_never_merge_past_its_end():
    buddy = BuddyAllocator(13)  # 8 + 4 + 1
    assert buddy.free_runs() == [1, 0, 1, 1]
    assert not buddy.can_allocate([4])  # 16 blocks: more than the pool
    starts = [buddy.allocate(2), buddy.allocate(2), buddy.allocate(2)]  # the run of 4 first, then 8 split
    assert starts == [8, 0, 4]
    buddy.check_invariants()
    for start in starts:
        buddy.free(start)
    buddy.check_invariants()
    assert buddy.free_runs() == [1, 0, 1, 1]  # 0-3 and 4-7 merge back into 8; 8-11 has no buddy inside the pool


def test_free_blocks_in_total_are_not_enough_when_they_are_scattered():
    """External fragmentation: 8 blocks are free, but no aligned run of 4 is."""
    buddy = BuddyAllocator(16)
    starts = [buddy.allocate(1) for _ in range(8)]
    for start in starts[::2]:
        buddy.free(start)
    assert buddy.num_free_blocks == 8
    assert not buddy.can_allocate([2])
    assert buddy.can_allocate([1, 1, 1, 1])


def test_can_allocate_agrees_with_allocate():
    buddy = BuddyAllocator(24)
    for orders in ([3, 3, 3], [4, 3], [4, 3, 0], [2] * 6, [1] * 12, [4, 4]):
        expected = buddy.can_allocate(orders)
        trial = BuddyAllocator(24)
        try:
            for order in sorted(orders, reverse=True):
                trial.allocate(order)
            ok = True
        except RuntimeError:
            ok = False
        assert ok == expected, orders


def test_double_free_is_refused():
    buddy = BuddyAllocator(8)
    start = buddy.allocate(1)
    buddy.free(start)
    with pytest.raises(RuntimeError, match="double free"):
        buddy.free(start)


# --- reservation sizes ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy, prompt, output, expected",
    [
        (KVPolicy.ORCA_ORACLE, 10, 7, 17),
        (KVPolicy.ORCA_POW2, 10, 7, 18),  # 7 -> 8
        (KVPolicy.ORCA_POW2, 10, 8, 18),  # a power of two already
        (KVPolicy.ORCA_POW2, 10, 9, 26),  # 9 -> 16: at most twice the output
        (KVPolicy.ORCA_MAX, 10, 7, 64),
        (KVPolicy.STATIC, 10, 7, 64),
        (KVPolicy.ORCA_POW2, 40, 40, 64),  # never past the context
    ],
)
def test_reserved_tokens_per_policy(policy, prompt, output, expected):
    assert reserved_tokens(policy, prompt, output, max_model_len=64) == expected


@pytest.mark.parametrize(
    "policy, blocks",
    [("orca-oracle", 8), ("orca-pow2", 8), ("orca-max", 16)],  # 17 / 18 / 64 tokens in blocks of 4, rounded up to 2^k
)
def test_a_reservation_is_a_power_of_two_of_blocks(policy, blocks):
    h = PolicyHarness(policy)
    group = h.add("r", prompt_len=10, max_tokens=7)
    h.step()
    assert h.bm.num_free_blocks == 32 - blocks
    table = h.bm.block_ids(group.seqs[0].seq_id)
    assert table == list(range(table[0], table[0] + 3)) and table[0] % blocks == 0  # contiguous, aligned
    h.run()
    assert h.bm.num_free_blocks == 32


def test_the_paged_policy_builds_the_paged_scheduler():
    h = PolicyHarness("paged")
    assert type(h.scheduler).__name__ == "Scheduler" and not isinstance(h.bm, ReservationBlockManager)


# --- admission and no preemption ------------------------------------------------------------------


def test_orca_admits_only_what_its_reservations_fit_and_never_preempts():
    # Max reserves the whole context (16 blocks of 4): two requests fit in 32 blocks, not three.
    h = PolicyHarness("orca-max")
    for i in range(3):
        h.add(f"r{i}", prompt_len=6, max_tokens=20)
    out = h.step()
    assert sorted({s.request_id for s in out.seqs}) == ["r0", "r1"]
    assert [g.request_id for g in h.scheduler.waiting] == ["r2"]
    h.run()
    assert h.scheduler.stats.num_preemptions == 0
    assert h.finished["r2"] > h.finished["r0"]


def test_a_waiting_request_blocks_the_ones_behind_it_first_come_first_served():
    h = PolicyHarness("orca-oracle", num_blocks=16)
    h.add("big", prompt_len=30, max_tokens=30)  # 60 tokens: 15 blocks -> a run of 16
    h.add("small", prompt_len=4, max_tokens=4)
    h.step()
    h.add("late-big", prompt_len=30, max_tokens=30)
    h.add("late-small", prompt_len=2, max_tokens=2)
    h.run()
    assert h.finished["late-small"] > h.finished["big"]  # it waited behind late-big, which waited for big


def test_orca_holds_fewer_sequences_than_paged_memory_on_the_same_requests():
    batches = {}
    for policy in ("paged", "orca-oracle", "orca-pow2", "orca-max"):
        h = PolicyHarness(policy, num_blocks=32)
        for i in range(12):
            h.add(f"r{i}", prompt_len=3 + i % 5, max_tokens=5 + 3 * (i % 4))
        batches[policy] = len({s.request_id for s in h.step().seqs})
        h.run()
        assert h.scheduler.stats.num_preemptions == 0 or policy == "paged"
    assert batches["paged"] >= batches["orca-oracle"] >= batches["orca-max"]
    assert batches["paged"] > batches["orca-max"]


def test_a_request_larger_than_the_pool_fails_instead_of_waiting_forever():
    h = PolicyHarness("orca-max", num_blocks=12)  # the largest run is 8 blocks; Max wants 16
    group = h.add("r", prompt_len=4, max_tokens=4)
    h.step()
    assert h.failed == [group] and "reservation" in group.error
    assert not h.scheduler.has_unfinished()


# --- samples and beams: a reservation each, forks copy ----------------------------------------------


def test_parallel_samples_reserve_one_run_each_and_a_fork_copies_blocks():
    h = PolicyHarness("orca-oracle")
    group = h.add("r", prompt_len=9, max_tokens=5, n=3)  # 14 tokens: 4 blocks each
    out = h.step()
    assert h.bm.num_free_blocks == 32 - 3 * 4  # all three runs taken at admission
    assert out.blocks_to_copy == []  # the prompt step forks after it is computed ...
    out = h.step()
    assert len(out.blocks_to_copy) == 2 * 3  # ... and the next step copies its 3 blocks to each child
    tables = [h.bm.block_ids(s.seq_id) for s in group.seqs]
    assert len({t[0] for t in tables}) == 3  # nothing shared
    h.run()
    assert h.bm.num_free_blocks == 32


def test_beams_reserve_one_run_each_and_stay_within_them():
    h = PolicyHarness("orca-pow2", num_blocks=64)
    h.add("b", prompt_len=5, max_tokens=6, n=3, beam=True)
    h.step()
    held = 64 - h.bm.num_free_blocks
    assert held == 3 * 4  # 5 + 8 tokens -> 4 blocks, one run per beam
    h.run()
    assert h.scheduler.stats.num_preemptions == 0 and h.bm.num_blocks_copied > 0
    assert h.bm.num_free_blocks == 64


# --- static batching -------------------------------------------------------------------------------


def test_static_batches_are_as_large_as_memory_allows_and_wait_for_their_longest():
    h = PolicyHarness("static", num_blocks=48)  # max-length runs of 16 blocks: batches of 3
    lengths = [2, 20, 3, 4, 5, 6]
    for i, n in enumerate(lengths):
        h.add(f"r{i}", prompt_len=4, max_tokens=n)
    first = h.step()
    assert sorted({s.request_id for s in first.seqs}) == ["r0", "r1", "r2"]
    assert h.scheduler.num_batches == 1
    admitted_second = None
    while h.scheduler.has_unfinished():
        out = h.step()
        if admitted_second is None and any(s.request_id == "r3" for s in out.seqs):
            admitted_second = h.num_steps
    assert h.finished["r0"] < h.finished["r1"]  # sequences finish on their own ...
    assert admitted_second == h.finished["r1"] + 1  # ... but the next batch waits for the longest
    assert h.scheduler.num_batches == 2


def test_a_static_batch_computes_its_prompts_in_one_step_whatever_the_budget():
    h = PolicyHarness("static", num_blocks=48, budget=8)
    for i in range(3):
        h.add(f"r{i}", prompt_len=6, max_tokens=2)
    out = h.step()
    assert [len(s.token_ids) for s in out.seqs] == [6, 6, 6]
    assert isinstance(h.scheduler, ReservationScheduler) and h.scheduler.current_batch == list(h.scheduler.running)


def test_order_for_rounds_up_to_a_power_of_two():
    assert [order_for(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]


def test_a_model_of_two_kv_cache_groups_reserves_a_span_for_each():
    """A hybrid model (full and windowed layers) under a reservation policy: each sequence's run
    holds one span per group, so the groups' tables never share a block, and windows free
    nothing (the run is reserved whole)."""
    from pagedllm.config import SchedulerConfig
    from pagedllm.core import Sequence, SequenceGroup
    from pagedllm.sampling_params import SamplingParams

    bm = ReservationBlockManager(KVPolicy.ORCA_ORACLE, 4, 64, max_model_len=64, num_groups=2)
    scheduler = ReservationScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    group = SequenceGroup("r", [Sequence(0, list(range(10)))], SamplingParams(max_tokens=6, ignore_eos=True), 0.0)
    scheduler.add(group)
    out = scheduler.schedule()
    (item,) = out.seqs
    full, windowed = item.block_tables
    assert len(full) == len(windowed) == 3 and not set(full) & set(windowed)
    assert bm.num_free_blocks == 64 - 8  # ceil(15 / 4) = 4 blocks a group, 8 in a run of 8
    bm.check_invariants()
