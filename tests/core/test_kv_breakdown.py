"""The KV memory breakdown (the paper's Figure 2) is an exact partition of the device pool.

Random workloads (prompts, output lengths, parallel samples, beams, staggered arrivals) run under
every memory policy; after every step the four parts are non-negative, add up to the pool's
slots, and token states are exactly the slots that hold a computed token, counted once per
physical block however many sequences share it.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from pagedllm.config import KV_POLICIES
from pagedllm.core import KVBreakdown, ReservationBlockManager
from pagedllm.core.kv_breakdown import PARTS, KVBreakdownAverage
from tests.core.policy_harness import PolicyHarness

MAX_MODEL_LEN = 32

requests = st.lists(
    st.tuples(
        st.integers(0, 8),  # the step it arrives before
        st.integers(1, 12),  # prompt tokens
        st.integers(1, 12),  # output tokens
        st.sampled_from([(1, False), (2, False), (3, False), (2, True), (3, True)]),  # (n, beam)
    ),
    min_size=1,
    max_size=8,
)


def live_seqs(h: PolicyHarness):
    return [seq for group in h.scheduler.running for seq in group.seqs if not seq.is_finished]


def expected_token_states(h: PolicyHarness) -> int:
    """Slots holding a computed token, from the block tables: each physical block once."""
    bs = h.bm.block_size
    filled: dict[int, int] = {}
    for seq in live_seqs(h):
        if not h.bm.has_blocks(seq.seq_id):
            continue
        for index, block in enumerate(h.bm.block_ids(seq.seq_id)):
            fill = min(bs, max(0, seq.num_computed_tokens - index * bs))
            filled[block] = max(filled.get(block, 0), fill)
    return sum(filled.values())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(KV_POLICIES),
    block_size=st.sampled_from([1, 2, 3, 4]),
    num_blocks=st.integers(10, 48),
    workload=requests,
)
def test_the_four_parts_partition_the_pool_at_every_step(policy, block_size, num_blocks, workload):
    h = PolicyHarness(policy, block_size=block_size, num_blocks=num_blocks, max_model_len=MAX_MODEL_LEN, budget=32)
    pending = sorted(enumerate(workload), key=lambda item: item[1][0])
    pool = num_blocks * block_size
    step = ran = 0
    while pending or h.scheduler.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt_len, max_tokens, (n, beam)) = pending.pop(0)
            h.add(f"r{i}", prompt_len, max_tokens, n=n, beam=beam)
        h.step()
        ran += h.core.last_scheduled is not None  # a step with nothing to run samples nothing
        step += 1
        assert step < 500
        parts = h.bm.slot_breakdown(live_seqs(h))
        assert isinstance(parts, KVBreakdown)
        assert all(getattr(parts, part) >= 0 for part in PARTS), parts
        assert parts.num_slots == pool
        assert parts.token_states == expected_token_states(h)
        if isinstance(h.bm, ReservationBlockManager):
            held = (num_blocks - h.bm.num_free_blocks) * block_size
            assert parts.external_fragmentation_free == pool - held
        else:
            assert parts.reservation == 0  # paged memory reserves nothing ahead
            assert parts.internal_fragmentation < block_size * max(1, len(live_seqs(h)))
    fractions = h.scheduler.kv_breakdown.fractions()
    assert h.scheduler.kv_breakdown.num_steps == ran
    assert abs(sum(fractions.values()) - 1.0) < 1e-9


def test_reservations_split_into_token_states_reserved_and_fragmented_slots():
    # Oracle, blocks of 4: 10 prompt + 7 output tokens reserve 17 -> 5 blocks -> a run of 8 (32 slots).
    h = PolicyHarness("orca-oracle", block_size=4, num_blocks=32)
    h.add("r", prompt_len=10, max_tokens=7)
    h.step()  # the prompt is computed
    parts = h.bm.slot_breakdown(live_seqs(h))
    assert parts.token_states == 10
    assert parts.reservation == 16 - 10  # the final KV length is 10 + 7 - 1 = 16
    assert parts.internal_fragmentation == 32 - 16
    assert parts.external_fragmentation_free == 128 - 32


def test_paged_memory_wastes_only_the_tail_of_each_last_block():
    h = PolicyHarness("paged", block_size=4, num_blocks=32)
    h.add("r", prompt_len=10, max_tokens=7)
    h.step()
    parts = h.bm.slot_breakdown(live_seqs(h))
    assert (parts.token_states, parts.reservation, parts.internal_fragmentation) == (10, 0, 2)
    assert parts.external_fragmentation_free == 128 - 12


def test_the_average_weighs_every_step_alike():
    average = KVBreakdownAverage()
    average.add(KVBreakdown(token_states=10, external_fragmentation_free=30))
    average.add(KVBreakdown(token_states=30, internal_fragmentation=10))
    assert average.fractions() == {
        "token_states": 0.5, "reservation": 0.0, "internal_fragmentation": 0.125, "external_fragmentation_free": 0.375
    }
