"""Speculative decoding's controller and proposer, without a model: the n-gram lookup, the
choice of how many proposed tokens to verify (cost lines, acceptance rates, prompts in the
step), and that choice against the one-token-at-a-time greedy it implements."""

from __future__ import annotations

import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.config import SpeculativeConfig
from pagedllm.core import Sequence
from pagedllm.engine.spec_controller import SpecController
from pagedllm.engine.spec_decode import NgramProposer


def test_ngram_proposer_continues_the_latest_longest_match():
    proposer = NgramProposer(max_n=3, min_n=1)
    #            0  1  2  3  4  5  6  7  8  9 10 11
    seq = Sequence(0, [5, 6, 7, 1, 2, 9, 6, 7, 3, 4, 6, 7])
    # Suffix [6, 7] occurs at 1-2 (then 1, 2) and 6-7 (then 3, 4): the latest wins.
    assert proposer.propose(seq, 2) == [3, 4]
    seq = Sequence(1, [5, 6, 7, 1, 2, 9, 6, 7, 3, 4, 5, 6, 7])
    # [5, 6, 7] occurs only at the start: the longer match beats the later, shorter one.
    assert proposer.propose(seq, 3) == [1, 2, 9]
    assert NgramProposer(max_n=3, min_n=2).propose(Sequence(2, [1, 2, 3, 4, 3]), 2) == []  # only a 1-gram matches
    seq.append_token(1, 0.0)  # the proposer's copy follows the sequence as it grows
    assert proposer.propose(seq, 2) == [2, 9]


def test_ngram_proposer_states_how_long_its_match_is():
    """The match length counts every token before the proposal's source that agrees with the
    sequence's own last tokens, past prompt_lookup_max (up to NgramProposer.MAX_MATCH)."""
    proposer = NgramProposer(max_n=4, min_n=2)
    #                0  1  2  3  4  5  6  7  8  9
    seq = Sequence(0, [1, 2, 3, 4, 5, 9, 9, 3, 4, 5])
    assert proposer.propose(seq, 2) == [9, 9]  # [3, 4, 5] at 2-4; before it 2, here 9
    assert proposer.match_lengths[0] == 3
    copied = list(range(100, 140))
    seq = Sequence(1, copied + [7] + copied[:25])
    assert proposer.propose(seq, 3) == copied[25:28]
    assert proposer.match_lengths[1] == 25
    seq = Sequence(2, copied + copied)
    proposer.propose(seq, 3)
    assert proposer.match_lengths[2] == NgramProposer.MAX_MATCH


def test_a_long_match_is_verified_further_than_a_short_one():
    """Proposals after a long match are usually right for many tokens, after a 2-token match
    often wrong at once (measured on the default model): the same sequence verifies more after
    the long one, and nothing after short ones that keep failing."""
    controller = SpecController()
    for tokens in range(1, 18):
        controller.observe_step(tokens, tokens > 1, 0.010 + 0.001 * tokens)
    for _ in range(40):
        controller.observe_tokens(0, list(range(8)), list(range(8)) + [99], match_length=20)
        controller.observe_tokens(0, list(range(8)), [99], match_length=2)
    proposal = {0: list(range(16))}
    long = controller.choose(proposal, 1, 1, False, 100, match_lengths={0: 20})[0]
    short = controller.choose(proposal, 1, 1, False, 100, match_lengths={0: 2})[0]
    assert long >= 8 and short == 0
    assert controller.choose(proposal, 1, 1, False, 100, match_lengths={0: 5})[0] > 0  # unmeasured bucket: its prior


def test_a_sequence_whose_proposals_keep_failing_verifies_less_than_its_bucket_expects():
    """The buckets are shared by the engine's sequences: after others' 2-token matches were right
    half the time, a fresh sequence's 2-token match is verified far; one whose own proposals of
    that bucket failed five times in a row verifies fewer tokens in the same state (none here),
    and one whose proposals were all right no fewer (its record corrects the bucket's
    first-token chance)."""
    controller = SpecController()
    for tokens in range(1, 18):
        controller.observe_step(tokens, tokens > 1, 0.010 + 0.004 * tokens)
    for seq in range(1, 41):
        controller.observe_tokens(seq, list(range(8)), (list(range(8)) if seq % 2 else []) + [99], match_length=2)
    for _ in range(5):
        controller.observe_tokens(200, list(range(8)), [99], match_length=2)
        controller.observe_tokens(300, list(range(8)), list(range(8)) + [99], match_length=2)

    def chosen(seq_id: int) -> int:
        return controller.choose({seq_id: list(range(16))}, 1, 1, False, 100, match_lengths={seq_id: 2})[seq_id]

    fresh, failing, right = chosen(100), chosen(200), chosen(300)
    assert fresh > 0 and failing < fresh <= right
    controller.forget({100, 300})
    assert chosen(200) == fresh  # a finished sequence's record is dropped: the bucket's word alone


def _controller(step_s: float, per_token_s: float, rate: float, seqs: int) -> SpecController:
    """A controller that measured steps of `step_s` + `per_token_s` a query token, and proposals
    accepted whole at `rate` (else rejected at once), of no stated match length and of long
    n-gram matches (32 tokens)."""
    controller = SpecController()
    for tokens in (seqs, seqs + 4, seqs + 8, seqs, seqs + 16):
        controller.observe_step(tokens, False, step_s + per_token_s * tokens)
        controller.observe_step(tokens + 1, True, step_s + per_token_s * (tokens + 1))
    for seq_id in range(seqs):
        for _ in range(20):
            matched = 8 if torch.rand(1).item() < rate else 0
            controller.observe_tokens(seq_id, list(range(9)), list(range(matched)) + [99])
            controller.observe_tokens(seq_id, list(range(9)), list(range(matched)) + [99], match_length=32)
    return controller


def test_controller_verifies_long_proposals_when_cheap_and_accepted():
    controller = _controller(step_s=0.01, per_token_s=0.001, rate=1.0, seqs=1)
    assert controller.choose({0: list(range(8))}, base_tokens=1, base_outputs=1, base_multi=False, budget=100) == {0: 8}


def test_controller_verifies_nothing_under_load_or_low_acceptance():
    loaded = _controller(step_s=0.01, per_token_s=0.002, rate=0.3, seqs=64)
    proposals = {seq_id: list(range(8)) for seq_id in range(64)}
    chosen = loaded.choose(proposals, base_tokens=64, base_outputs=64, base_multi=False, budget=1000)
    assert sum(chosen.values()) == 0
    rejected = _controller(step_s=0.01, per_token_s=0.002, rate=0.0, seqs=1)
    assert rejected.choose({0: list(range(8))}, 1, 1, False, 100) == {0: 0}


def test_controller_follows_a_step_cost_that_jumps_at_five_tokens():
    """Products of 1-4 rows cost about one row's on the CPU, from 5 rows about twice: the
    controller verifies 3 tokens (4 query tokens), where a line through the same steps would
    have it verify 5."""
    def seconds(tokens: int) -> float:
        return 0.010 if tokens <= 4 else 0.020 + 0.001 * tokens

    controller = SpecController()
    for _ in range(3):
        for tokens in range(1, 18):
            controller.observe_step(tokens, tokens > 1, seconds(tokens))
    for n in range(40):  # 4.5 tokens matched per mismatch: an acceptance rate of about 0.8
        controller.observe_tokens(0, list(range(9)), list(range(4 + n % 2)) + [99])
    assert controller.choose({0: list(range(16))}, base_tokens=1, base_outputs=1, base_multi=False, budget=100) == {0: 3}


def test_prompts_in_the_step_neither_cheapen_verifying_nor_wait_for_it():
    """The choice weighs verified tokens against the step's decodes alone (counted in the step's
    time, a prompt chunk made any verified token look cheap), prompts take their share of the
    token budget first, and while the step-time budget holds admissible prompts back nothing is
    verified: 64 grounded requests at once ran at 0.89-0.92x the plain engine's rate, with half
    as many sequences running, when proposals lengthened the steps that admit prompts."""
    import copy
    from types import SimpleNamespace

    from pagedllm.core import SequenceGroup
    from pagedllm.engine.spec_decode import Speculator

    torch.manual_seed(0)
    controller = _controller(step_s=0.01, per_token_s=0.001, rate=0.5, seqs=4)

    def step_with(waiting_prompt: int, chunk_limit: int | None, max_num_seqs: int = 8) -> dict[int, int]:
        speculator = Speculator(SpeculativeConfig(num_speculative_tokens=8, prompt_lookup_min=1), 4096, 2048)
        speculator.controller = copy.deepcopy(controller)
        running = []
        for seq_id in range(4):  # decoding, each with a proposal ([1, 2, ...] repeats)
            seq = Sequence(seq_id, [1, 2, 3, 4, 5, 6, 7, 8, 9] * 3 + [1])
            seq.num_computed_tokens = seq.num_tokens - 1
            running.append(SequenceGroup(str(seq_id), [seq], SamplingParams(temperature=0), 0.0))
        waiting = [SequenceGroup("p", [Sequence(9, list(range(waiting_prompt)))], SamplingParams(), 0.0)] if waiting_prompt else []
        drafts = speculator.propose(SimpleNamespace(running=running, waiting=waiting, num_running_seqs=4,
                                                    config=SimpleNamespace(max_num_seqs=max_num_seqs)), chunk_limit)
        return {seq.seq_id: len(drafts.get(seq.seq_id, [])) for g in running for seq in g.seqs}

    alone = step_with(0, None)
    assert 0 < sum(alone.values()) < 4 * 8  # the controller verifies some, not all
    assert step_with(200, 256) == alone  # the whole prompt fits in this step's chunk
    assert step_with(1500, None) == alone  # no step-time budget; 1500 + 4 decodes leave room
    assert sum(step_with(2040, None).values()) <= 2048 - 2040 - 4  # the token budget is what is left
    assert sum(step_with(1500, 256).values()) == 0  # the budget holds the prompt back
    assert step_with(1500, 256, max_num_seqs=4) == alone  # no seat for it: nothing held back


def _greedy_choice(controller: SpecController, proposals, base_tokens, base_outputs, base_multi, budget,
                   match_lengths=None):
    """The choice as the docs state it, one token at a time: the best marginal gain next (a
    heap), the step's value after each, the best total kept."""
    import heapq

    match_lengths = match_lengths or {}
    gains = {s: controller.gains(s, len(p), match_lengths.get(s)) for s, p in proposals.items()}
    heap = [(-gains[s][0], s, 1) for s, p in proposals.items() if p]
    heapq.heapify(heap)
    gain, extra, taken = float(base_outputs), 0, []
    best_value, best_extra = gain / controller.cost(base_tokens, base_multi), 0
    while heap and extra < budget:
        neg, s, j = heapq.heappop(heap)
        gain, extra = gain - neg, extra + 1
        taken.append(s)
        if gain / controller.cost(base_tokens + extra, True) > best_value:
            best_value, best_extra = gain / controller.cost(base_tokens + extra, True), extra
        if j < len(proposals[s]):
            heapq.heappush(heap, (-gains[s][j], s, j + 1))
    chosen = dict.fromkeys(proposals, 0)
    for s in taken[:best_extra]:
        chosen[s] += 1
    return chosen


def test_the_controller_chooses_as_adding_the_best_token_at_a_time_does():
    """`choose` sorts every marginal gain at once (a step of 64 sequences with 16 proposed tokens
    each took 4 ms one token at a time, a few percent of the step): the same choice."""
    import random

    rng = random.Random(0)
    verified = 0
    for _ in range(200):
        controller, seqs = SpecController(), rng.choice([1, 2, 5, 16, 64])
        a, b = rng.uniform(0.005, 0.05), rng.uniform(0.0002, 0.003)
        for _ in range(rng.randint(0, 6)):
            tokens = rng.randint(1, 80)
            controller.observe_step(tokens, False, a + b * tokens * rng.uniform(0.8, 1.2))
            controller.observe_step(tokens + 1, True, a + b * (tokens + 1) * rng.uniform(0.8, 1.6))
        match_lengths = {s: rng.randint(1, 40) for s in range(seqs) if rng.random() < 0.5}
        for s in range(seqs):
            rate = rng.random()
            for _ in range(rng.randint(0, 10)):
                matched = 8 if rng.random() < rate else rng.randint(0, 3)
                controller.observe_tokens(s, list(range(9)), list(range(matched)) + [99], match_lengths.get(s))
        proposals = {s: list(range(rng.randint(0, 16))) for s in range(seqs)}
        base = seqs + rng.choice([0, 0, 100])
        args = (proposals, base, seqs, base > seqs, rng.choice([0, 3, 10, 2000]), match_lengths)
        chosen = controller.choose(*args)
        assert chosen == _greedy_choice(controller, *args)
        verified += sum(chosen.values())
    assert verified > 0


def test_with_a_draft_model_a_new_sequence_starts_from_the_measured_acceptance():
    # Drafts that the target rejected at once (1 token matched in 10): a sequence not seen yet
    # is assumed to accept as rarely, not at least 0.3; n-gram proposals keep that floor.
    from pagedllm.engine.spec_decode import Speculator

    draft = Speculator(SpeculativeConfig(method="draft_model", model="draft"), 256, 64, draft=object())
    ngram = Speculator(SpeculativeConfig(), 256, 64)
    for speculator in (draft, ngram):
        for n in range(30):
            speculator.controller.observe_tokens(n, [1, 2, 3], [1, 9] if n % 10 == 0 else [9])
    measured = draft.controller.overall.rate(0.5)
    assert measured < 0.15
    assert draft.controller.rate(100) == pytest.approx(measured)
    assert ngram.controller.rate(100) == pytest.approx(0.3)


def test_while_nothing_is_verified_only_every_fourth_sequence_is_looked_up():
    """With several sequences running and nothing verified in the last step, the n-gram lookup
    runs for one sequence in PROBE_EVERY, in turn (it was about 1% of a step of 64 sequences
    that never verify); once a step verifies, every sequence is looked up again."""
    from types import SimpleNamespace

    from pagedllm.core import SequenceGroup
    from pagedllm.engine.spec_decode import Speculator

    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=8), 4096, 2048)
    looked_up = []
    lookup = speculator.proposer.propose
    speculator.proposer.propose = lambda seq, k: looked_up.append(seq.seq_id) or lookup(seq, k)
    running = []
    for seq_id in range(8):  # random-looking tokens: no n-gram repeats, nothing proposed
        seq = Sequence(seq_id, [(seq_id * 7919 + i * 104729) % 50000 for i in range(40)])
        seq.num_computed_tokens = seq.num_tokens - 1
        running.append(SequenceGroup(str(seq_id), [seq], SamplingParams(temperature=0), 0.0))
    scheduler = SimpleNamespace(running=running, waiting=[], num_running_seqs=8,
                                config=SimpleNamespace(max_num_seqs=8))
    speculator.propose(scheduler)
    assert sorted(looked_up) == list(range(8))  # the first step looks every sequence up
    seen = set()
    for step in range(1, 5):
        looked_up.clear()
        speculator._steps = step
        speculator.propose(scheduler)
        assert len(looked_up) == 2 and all(s % Speculator.PROBE_EVERY == step % Speculator.PROBE_EVERY for s in looked_up)
        seen.update(looked_up)
    assert seen == set(range(8))  # every sequence in turn
    speculator._verified_last = True  # a step that verified: every sequence again
    looked_up.clear()
    speculator.propose(scheduler)
    assert sorted(looked_up) == list(range(8))
