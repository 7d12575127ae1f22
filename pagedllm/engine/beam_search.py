"""Beam search inside the engine, with beams sharing KV blocks (the paper's section 4.4).

Every step, each live beam proposes its best continuations; the group keeps the `beam_width`
best by cumulative log-probability. A new beam that descends from a surviving parent reuses the
parent's sequence; further children fork it, sharing all its blocks (the partly filled last
block is copied on the first write); a parent with no surviving child is dropped and its blocks
are released at once. Beams that end (EOS, a stop token, or the length limit) join a pool of
finished hypotheses scored with the length penalty.

The stopping rule is the one of `transformers` (`generate(num_beams=..., early_stopping=...)`):
- `early_stopping=True`: stop once `beam_width` hypotheses are finished;
- `False` (default): stop once the best live beam, scored at the current length, cannot beat
  the worst of a full pool of finished hypotheses;
- `"never"`: as `False`, but with a positive length penalty the live beam is scored at the
  maximum length (the canonical, exhaustive rule);
- always when the length limit is reached. Only candidates ranked in the top `beam_width` of a
  step may finish there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.core.model_output import SampledToken
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from pagedllm.engine.output_processor import OutputProcessor


@dataclass
class BeamState:
    """Per-request beam bookkeeping that outlives individual beams."""

    finished: list[tuple[float, Sequence]] = field(default_factory=list)  # (score, hypothesis), best first
    improvable: bool = True  # transformers' early-stop heuristic, sticky once False


def _score(cumulative_logprob: float, length: int, length_penalty: float) -> float:
    return cumulative_logprob / (length**length_penalty)


def ranked_beams(group: SequenceGroup) -> list[Sequence]:
    """Finished hypotheses best first; while running, the live beams best first."""
    state: BeamState | None = group.beam_state
    if group.is_finished and state is not None and state.finished:
        return [seq for _, seq in state.finished]
    return sorted(group.unfinished_seqs(), key=lambda s: s.cumulative_logprob, reverse=True)


def step_beams(processor: "OutputProcessor", group: SequenceGroup, proposals: list[tuple[Sequence, list[SampledToken]]]) -> None:
    params = group.sampling_params
    width = params.best_of
    state: BeamState = group.beam_state or BeamState()
    group.beam_state = state
    parents = [seq for seq, _ in proposals]
    generated = parents[0].num_output_tokens  # all live beams have the same length
    max_new = processor.max_tokens(parents[0], params)
    at_limit = generated + 1 >= max_new

    # The K best continuations over all beams (K = max(2, 1 + #stop tokens) * width, as transformers).
    num_keep = max(2, 1 + len(params.all_stop_token_ids)) * width
    candidates = sorted(
        ((seq.cumulative_logprob + s.logprob, seq, s) for seq, samples in proposals for s in samples),
        key=lambda c: c[0],
        reverse=True,
    )[:num_keep]

    pool_full_early = len(state.finished) >= width and params.early_stopping is True
    survivors: list[tuple[Sequence, SampledToken]] = []
    for rank, (score, parent, sample) in enumerate(candidates):
        ends = at_limit or sample.token_id in params.all_stop_token_ids
        if not ends:
            if len(survivors) < width:
                survivors.append((parent, sample))
            continue
        if rank < width and state.improvable and not pool_full_early:
            _add_finished(processor, group, state, parent, sample, score, generated + 1, at_limit)

    # Is improvement still possible? (checked with the new best live beam, as transformers does)
    if survivors:
        best = survivors[0][0].cumulative_logprob + survivors[0][1].logprob
        length = generated + 1
        if params.early_stopping == "never" and params.length_penalty > 0:
            length = max_new
        worst_finished = state.finished[-1][0] if len(state.finished) >= width else float("-inf")
        state.improvable = state.improvable and _score(best, length, params.length_penalty) > worst_finished
    done = (
        not survivors
        or at_limit
        or not state.improvable
        or (len(state.finished) >= width and params.early_stopping is True)
    )
    if done:
        for seq in group.unfinished_seqs():
            processor.drop(seq)
        group.seqs = [seq for _, seq in state.finished] or group.seqs
        return
    _advance(processor, group, parents, survivors)


def _add_finished(processor, group, state: BeamState, parent: Sequence, sample: SampledToken, score: float, length: int, at_limit: bool) -> None:
    params = group.sampling_params
    hypothesis = parent.fork(processor.new_seq_id())  # a record only: it holds no blocks
    if parent.detokenizer is not None:
        hypothesis.detokenizer = parent.detokenizer.fork()
    processor.append_beam_token(group, hypothesis, sample)
    stopped = sample.token_id in params.all_stop_token_ids
    hypothesis.status = SequenceStatus.FINISHED_STOPPED if stopped else SequenceStatus.FINISHED_LENGTH
    if stopped and sample.token_id in params.stop_token_ids:
        hypothesis.stop_reason = sample.token_id
    hypothesis.output_text += hypothesis.detokenizer.flush()
    state.finished.append((_score(score, length, params.length_penalty), hypothesis))
    state.finished.sort(key=lambda item: item[0], reverse=True)
    del state.finished[params.best_of :]


def _advance(processor, group: SequenceGroup, parents: list[Sequence], survivors: list[tuple[Sequence, SampledToken]]) -> None:
    """Turn the survivors into the next live beams, sharing blocks with their parents."""
    children: dict[int, list[SampledToken]] = {}
    for parent, sample in survivors:
        children.setdefault(parent.seq_id, []).append(sample)
    live: list[Sequence] = []
    for parent in parents:
        samples = children.get(parent.seq_id)
        if not samples:
            processor.drop(parent)  # no descendant: release its blocks now
            continue
        forks = [processor.fork(parent) for _ in samples[1:]]  # before the parent moves on
        for seq, sample in zip([parent, *forks], samples):
            processor.append_beam_token(group, seq, sample)
            live.append(seq)
    group.seqs = live
