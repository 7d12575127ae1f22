"""Beam search inside the engine, with beams sharing KV blocks (the paper's section 4.4).

Every step, each live beam proposes its best continuations; the group keeps the `beam_width`
best by cumulative log-probability. A new beam that descends from a surviving parent reuses the
parent's sequence; further children fork it, sharing all its blocks (the partly filled last
block is copied on the first write); a parent with no surviving child is dropped and its blocks
are freed at once. Beams that end (EOS, a stop token, or the length limit) join a pool of
finished hypotheses scored with the length penalty.

The stopping rule is the one of `transformers` (`generate(num_beams=..., early_stopping=...)`):
- `early_stopping=True`: stop once `beam_width` hypotheses are finished;
- `False` (default): stop once the best live beam, scored at the current length, cannot beat
  the worst of a full pool of finished hypotheses;
- `"never"`: as `False`, but with a positive length penalty the live beam is scored at the
  maximum length (the canonical, exhaustive rule);
- always when the length limit is reached. Only candidates ranked in the top `beam_width` of a
  step may finish there.

This module only decides (`decide_beam_step`); the output processor carries the decision out
(appending tokens, forking and freeing sequences).
"""

from __future__ import annotations

import math
import sys

from dataclasses import dataclass, field

from pagedllm.core.model_output import SampledToken
from pagedllm.core.sequence import BeamState, Sequence, SequenceGroup


@dataclass
class FinishedBeam:
    """A candidate that ends here: `parent` followed by `sample` becomes a finished hypothesis."""

    score: float  # with the length penalty
    parent: Sequence
    sample: SampledToken
    stopped: bool  # ended on a stop token (else on the length limit)


@dataclass
class BeamStep:
    """One step's decision for one beam search request."""

    finished: list[FinishedBeam] = field(default_factory=list)
    # The next live beams, grouped by parent in the parents' order: the first sample continues
    # the parent itself, each further one continues a fork of it.
    continued: list[tuple[Sequence, list[SampledToken]]] = field(default_factory=list)
    dropped: list[Sequence] = field(default_factory=list)  # live beams with no future
    improvable: bool = True  # the new value of `BeamState.improvable`
    done: bool = False  # the search is over: report the finished hypotheses


def length_penalized_score(cumulative_logprob: float, length: int, length_penalty: float) -> float:
    """transformers' `cumulative_logprob / length**length_penalty`, computed in log space: any
    finite penalty orders hypotheses (a huge one gives infinite scores) instead of overflowing
    (`length**400`) or dividing by zero (`length**-1e308`)."""
    try:
        return cumulative_logprob / (length**length_penalty)  # transformers' own numbers where they exist
    except (OverflowError, ZeroDivisionError):
        pass
    if cumulative_logprob == 0.0:
        return 0.0
    exponent = math.log(abs(cumulative_logprob)) - length_penalty * math.log(length)
    magnitude = math.inf if exponent > _LARGEST_EXPONENT else math.exp(exponent)
    return math.copysign(magnitude, cumulative_logprob)


# The largest x whose exp(x) is a finite float.
_LARGEST_EXPONENT = math.log(sys.float_info.max)


def ranked_beams(group: SequenceGroup) -> list[Sequence]:
    """Finished hypotheses best first; while running, the live beams best first."""
    state = group.beam_state
    if group.is_finished and state is not None and state.finished:
        return [seq for _, seq in state.finished]
    return sorted(group.unfinished_seqs(), key=lambda s: s.cumulative_logprob, reverse=True)


def add_hypothesis(state: BeamState, score: float, hypothesis: Sequence, beam_width: int) -> None:
    """Put a finished hypothesis in the pool, which keeps the `beam_width` best, best first."""
    state.finished.append((score, hypothesis))
    state.finished.sort(key=lambda item: item[0], reverse=True)
    del state.finished[beam_width:]


def decide_beam_step(
    group: SequenceGroup, proposals: list[tuple[Sequence, list[SampledToken]]], max_new_tokens: int
) -> BeamStep:
    """Which beams go on, which finish and which are dropped, given each live beam's proposed
    continuations. Reads the group and its `beam_state`; changes nothing."""
    params = group.sampling_params
    state = group.beam_state or BeamState()
    width = params.best_of
    parents = [seq for seq, _ in proposals]
    generated = parents[0].num_output_tokens  # all live beams have the same length
    length = generated + 1
    at_limit = length >= max_new_tokens

    # The K best continuations over all beams (K = max(2, 1 + #stop tokens) * width, as transformers).
    num_keep = max(2, 1 + len(params.all_stop_token_ids)) * width
    candidates = sorted(
        ((seq.cumulative_logprob + s.logprob, seq, s) for seq, samples in proposals for s in samples),
        key=lambda c: c[0],
        reverse=True,
    )[:num_keep]

    step = BeamStep()
    pool_full_early = len(state.finished) >= width and params.early_stopping is True
    survivors: list[tuple[Sequence, SampledToken]] = []
    for rank, (score, parent, sample) in enumerate(candidates):
        stopped = sample.token_id in params.all_stop_token_ids
        if not (at_limit or stopped):
            if len(survivors) < width:
                survivors.append((parent, sample))
            continue
        if rank < width and state.improvable and not pool_full_early:
            penalized = length_penalized_score(score, length, params.length_penalty)
            step.finished.append(FinishedBeam(penalized, parent, sample, stopped))

    # The pool's scores once this step's hypotheses are in it, best first.
    pool = sorted([s for s, _ in state.finished] + [f.score for f in step.finished], reverse=True)[:width]
    step.improvable = state.improvable
    if survivors:  # is improvement still possible? (checked with the new best live beam, as transformers does)
        best = survivors[0][0].cumulative_logprob + survivors[0][1].logprob
        best_length = max_new_tokens if params.early_stopping == "never" and params.length_penalty > 0 else length
        # A pool not yet full can always take a hypothesis (even one scored -inf by a huge penalty).
        step.improvable = state.improvable and (
            len(pool) < width or length_penalized_score(best, best_length, params.length_penalty) > pool[-1]
        )
    step.done = (
        not survivors
        or at_limit
        or not step.improvable
        or (len(pool) >= width and params.early_stopping is True)
    )
    if step.done:
        step.dropped = group.unfinished_seqs()
        return step
    children: dict[int, list[SampledToken]] = {}
    for parent, sample in survivors:
        children.setdefault(parent.seq_id, []).append(sample)
    for parent in parents:
        if parent.seq_id in children:
            step.continued.append((parent, children[parent.seq_id]))
        else:
            step.dropped.append(parent)
    return step
