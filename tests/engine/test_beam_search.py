"""Beam search without a model: decide_beam_step's choices from hand-made proposals, and the OutputProcessor's block sharing and freeing as it applies them."""

from __future__ import annotations

import pytest

from pagedllm.core import BeamState, Sequence, SequenceGroup, SequenceStatus
from pagedllm.core.model_output import ModelRunnerOutput, SampledToken, SequenceStepOutput
from pagedllm.engine.beam_search import decide_beam_step
from pagedllm.sampling_params import SamplingParams
from tests.engine.fakes import EOS, FakeEngine

PROMPT = [1, 2, 3]
WIDTH = 2


def beam_params(**kwargs) -> SamplingParams:
    params = SamplingParams(n=WIDTH, best_of=WIDTH, use_beam_search=True, temperature=0.0, **{"max_tokens": 10, **kwargs})
    params.all_stop_token_ids = {EOS}  # as the engine fills it in
    return params


def beam(seq_id: int, cumulative_logprob: float, num_generated: int = 1) -> Sequence:
    seq = Sequence(seq_id, list(PROMPT), output_token_ids=[4] * num_generated)
    seq.cumulative_logprob = cumulative_logprob
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.status = SequenceStatus.RUNNING
    return seq


def group_of(*beams: Sequence, params: SamplingParams | None = None, state: BeamState | None = None) -> SequenceGroup:
    return SequenceGroup("req", list(beams), params or beam_params(), arrival_time=0.0, beam_state=state)


def candidates(*pairs: tuple[int, float]) -> list[SampledToken]:
    return [SampledToken(token_id, logprob) for token_id, logprob in pairs]


def continued(step) -> list[tuple[int, list[int]]]:
    return [(parent.seq_id, [s.token_id for s in samples]) for parent, samples in step.continued]


def finished(step) -> list[tuple[int, int, float, bool]]:
    return [(f.parent.seq_id, f.sample.token_id, f.score, f.stopped) for f in step.finished]


# --- decide_beam_step -----------------------------------------------------------------------


def test_keeps_the_beam_width_best_continuations_by_cumulative_logprob():
    """A (-1) + 10 = -1.5 and B (-2) + 12 = -2.25 beat B + 13 = -2.5 and A + 11 = -4."""
    a, b = beam(0, -1.0), beam(1, -2.0)
    proposals = [(a, candidates((10, -0.5), (11, -3.0))), (b, candidates((12, -0.25), (13, -0.5)))]
    step = decide_beam_step(group_of(a, b), proposals, max_new_tokens=10)
    assert continued(step) == [(0, [10]), (1, [12])]


def test_parent_with_no_surviving_child_is_dropped_and_a_parent_with_two_continues_twice():
    """A + 10 = -1.25 and A + 11 = -1.5 beat both of B's (-2.25, -3)."""
    a, b = beam(0, -1.0), beam(1, -2.0)
    proposals = [(a, candidates((10, -0.25), (11, -0.5))), (b, candidates((12, -0.25), (13, -1.0)))]
    step = decide_beam_step(group_of(a, b), proposals, max_new_tokens=10)
    assert (continued(step), [s.seq_id for s in step.dropped]) == ([(0, [10, 11])], [1])


def test_stop_token_ranked_within_beam_width_finishes_with_its_length_penalized_score():
    """A + EOS = -1.5 ranks first: a hypothesis of length 2 scored -1.5 / 2 = -0.75. The live
    beams are the best two other candidates."""
    a, b = beam(0, -1.0), beam(1, -2.0)
    proposals = [(a, candidates((EOS, -0.5), (10, -1.0))), (b, candidates((12, -0.25), (13, -2.0)))]
    step = decide_beam_step(group_of(a, b), proposals, max_new_tokens=10)
    assert finished(step) == [(0, EOS, -0.75, True)]
    assert continued(step) == [(0, [10]), (1, [12])]


def test_stop_token_ranked_below_beam_width_does_not_finish():
    """B + EOS = -2.25 ranks third, behind A + 10 = -1.25 and A + 11 = -1.5."""
    a, b = beam(0, -1.0), beam(1, -2.0)
    proposals = [(a, candidates((10, -0.25), (11, -0.5))), (b, candidates((EOS, -0.25), (13, -1.0)))]
    step = decide_beam_step(group_of(a, b), proposals, max_new_tokens=10)
    assert step.finished == []


def length_limit_step():
    """Two tokens generated, a limit of 3: this step's tokens are the last."""
    a, b = beam(0, -1.0, num_generated=2), beam(1, -2.0, num_generated=2)
    proposals = [(a, candidates((10, -0.5), (11, -1.5))), (b, candidates((12, -0.25), (13, -2.0)))]
    return decide_beam_step(group_of(a, b), proposals, max_new_tokens=3)


def test_length_limit_ends_the_search_dropping_every_live_beam():
    step = length_limit_step()
    assert (step.done, continued(step), [s.seq_id for s in step.dropped]) == (True, [], [0, 1])


def test_at_the_length_limit_the_top_beam_width_candidates_become_hypotheses():
    """A + 10 = -1.5 and B + 12 = -2.25 rank first and second; at length 3 they score -0.5 and
    -0.75; A + 11 = -2.5 ranks third and is not kept."""
    assert finished(length_limit_step()) == [(0, 10, -0.5, False), (1, 12, -0.75, False)]


@pytest.mark.parametrize("early_stopping, expected_done", [(True, True), (False, False)])
def test_early_stopping_true_ends_the_search_once_beam_width_hypotheses_are_finished(early_stopping, expected_done):
    """One hypothesis (-5) is already finished; A + EOS (score -0.75 / 2) makes two. The best live
    beam (A + 10 = -1, score -0.5) still beats the worst hypothesis, so only early_stopping=True
    stops here."""
    record = beam(9, -10.0)
    state = BeamState(finished=[(-5.0, record)])
    a = beam(0, -0.5)
    proposals = [(a, candidates((EOS, -0.25), (10, -0.5), (11, -0.75), (12, -4.0)))]
    group = group_of(a, params=beam_params(early_stopping=early_stopping), state=state)
    step = decide_beam_step(group, proposals, max_new_tokens=10)
    assert len(step.finished) == 1
    assert step.done is expected_done


def snapshot(group: SequenceGroup, proposals) -> tuple:
    def seq_state(s: Sequence):
        return (s.seq_id, list(s.token_ids), list(s.output_token_ids), s.cumulative_logprob, s.status, s.num_computed_tokens, s.output_text)

    state = group.beam_state
    return (
        [seq_state(s) for s in group.seqs],
        [(score, seq_state(h)) for score, h in state.finished],
        state.improvable,
        [(seq.seq_id, [(t.token_id, t.logprob) for t in samples]) for seq, samples in proposals],
    )


def test_decide_beam_step_changes_nothing_in_its_inputs():
    """A step that finishes a hypothesis, forks A and drops B leaves the group, its beam state
    and the proposals as they were."""
    a, b = beam(0, -1.0), beam(1, -2.0)
    group = group_of(a, b, state=BeamState(finished=[(-3.0, beam(9, -6.0))]))
    proposals = [(a, candidates((EOS, -0.25), (10, -0.5), (11, -0.75))), (b, candidates((12, -3.0), (13, -4.0)))]
    before = snapshot(group, proposals)
    step = decide_beam_step(group, proposals, max_new_tokens=10)
    assert step.finished and step.dropped and continued(step) == [(0, [10, 11])]
    assert snapshot(group, proposals) == before


# --- through the OutputProcessor ------------------------------------------------------------


def proposals_for(by_seq: dict[int, list[tuple[int, float]]]):
    """A stand-in model: each beam's candidate continuations, by sequence id."""
    return lambda item: candidates(*by_seq[item.seq_id])


def start_beam_search(engine: FakeEngine, max_tokens: int = 4) -> SequenceGroup:
    """Width 2 over a 3-token prompt in 2-token blocks. The prompt's beam proposes 10 (-0.25) and
    11 (-0.5) first: both survive, so the beam forks."""
    group = engine.add("req", PROMPT, beam_params(max_tokens=max_tokens))
    root = group.seqs[0]
    engine.step(proposals_for({root.seq_id: [(10, -0.25), (11, -0.5), (12, -2.0), (13, -3.0)]}))
    return group


def test_forked_beams_share_their_parents_blocks():
    engine = FakeEngine(block_size=2, num_blocks=8)
    group = start_beam_search(engine)
    parent, child = group.seqs
    assert (parent.output_token_ids, child.output_token_ids) == ([10], [11])
    assert engine.bm.block_ids(child.seq_id) == engine.bm.block_ids(parent.seq_id)
    assert [engine.bm.ref_count(b) for b in engine.bm.block_ids(parent.seq_id)] == [2, 2]
    engine.bm.check_invariants()


def test_dropped_beam_frees_its_blocks_within_the_step_that_drops_it():
    """Step 2: both beams write position 3 in their shared second block, so the parent copies it
    (3 blocks in use). Both survivors descend from the parent (-0.5, -0.75 beat the child's
    -1.5): the child is dropped, and the scheduler frees its private block in the same step's
    update; the parent's new fork shares its 2 blocks."""
    engine = FakeEngine(block_size=2, num_blocks=8)
    group = start_beam_search(engine)
    parent, child = group.seqs

    def respond(out):
        assert len(out.blocks_to_copy) == 1 and engine.bm.num_free_blocks == 8 - 3
        return ModelRunnerOutput(
            {
                parent.seq_id: SequenceStepOutput(candidates((20, -0.25), (21, -0.5), (22, -3.0), (23, -4.0))),
                child.seq_id: SequenceStepOutput(candidates((24, -1.0), (25, -2.0), (26, -3.0), (27, -4.0))),
            }
        )

    engine.run_step(respond)
    assert not engine.bm.has_blocks(child.seq_id)
    assert engine.bm.num_free_blocks == 8 - 2
    engine.bm.check_invariants()


def test_a_step_whose_output_processing_fails_after_a_drop_still_frees_the_dropped_beam(monkeypatch):
    """The same step as above, but appending the survivors' tokens raises (after the child was
    dropped): the dropped beam, already out of its group, still gives its blocks back, and
    aborting the request (what the server's recovery does) leaves every block free."""
    engine = FakeEngine(block_size=2, num_blocks=8)
    group = start_beam_search(engine)
    parent, child = group.seqs

    def fail(*args):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine.processor, "_append_token", fail)
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.run_step(lambda out: ModelRunnerOutput({
            parent.seq_id: SequenceStepOutput(candidates((20, -0.25), (21, -0.5), (22, -3.0), (23, -4.0))),
            child.seq_id: SequenceStepOutput(candidates((24, -1.0), (25, -2.0), (26, -3.0), (27, -4.0))),
        }))
    assert not engine.bm.has_blocks(child.seq_id)
    engine.core.abort("req")
    assert engine.bm.live_tables() == {} and engine.bm.num_free_blocks == 8
    engine.bm.check_invariants()


def test_finished_search_leaves_every_block_free_and_reports_beam_width_hypotheses():
    engine = FakeEngine(block_size=2, num_blocks=8)
    group = start_beam_search(engine, max_tokens=4)
    for _ in range(10):
        if not engine.scheduler.has_unfinished():
            break
        engine.step(lambda item: candidates((30, -0.25), (31, -0.5), (32, -1.0), (33, -2.0)))
        engine.bm.check_invariants()
    assert not engine.scheduler.has_unfinished()
    assert engine.bm.live_tables() == {} and engine.bm.num_free_blocks == 8
    assert [(s.status, s.num_output_tokens) for s in group.seqs] == [(SequenceStatus.FINISHED_LENGTH, 4)] * WIDTH


@pytest.mark.parametrize("seed", range(6))
def test_a_beam_step_decides_the_same_with_few_candidates_as_with_transformers_many(seed):
    """The sampler picks per beam only its 2 * width best and its width best that do not stop
    (pagedllm.sampling.sampler); transformers keeps (1 + #stop tokens) * width. With many stop
    tokens among the likely ones, the beam step's decision is the same from either."""
    import torch

    from pagedllm.core.scheduler_output import ScheduledSequence
    from pagedllm.sampling.sampler import Sampler

    width, vocab = 4, 300
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(width, vocab, generator=generator) * 3
    stops = set(torch.randperm(vocab, generator=generator)[:120].tolist())  # 40% of the vocabulary stops
    params = SamplingParams(n=width, best_of=width, use_beam_search=True, temperature=0.0, max_tokens=10)
    params.all_stop_token_ids = stops
    items = [ScheduledSequence(seq_id=i, request_id="r", token_ids=[1], start_position=3, block_table=[0],
                               sampling_params=params, num_samples=1) for i in range(width)]
    log_probs = torch.log_softmax(logits, dim=-1)
    few = Sampler._beam_picks(logits.clone(), items, list(range(width)))
    k = min((1 + len(stops)) * width, vocab)
    beams = [beam(i, -float(i), num_generated=2) for i in range(width)]

    def decision(picks):
        proposals = [(b, [SampledToken(t, log_probs[i, t].item()) for t in picks[i].tolist()]) for i, b in enumerate(beams)]
        step = decide_beam_step(group_of(*beams, params=params), proposals, max_new_tokens=10)
        return continued(step), finished(step), [s.seq_id for s in step.dropped], step.done

    many = {i: torch.topk(logits[i], k).indices for i in range(width)}
    assert max(len(p) for p in few.values()) <= 3 * width < k
    assert decision(few) == decision(many)
