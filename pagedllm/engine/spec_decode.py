"""Speculative decoding's engine side: proposals, the per-step choice of how many to verify, and
the counters (docs/speculative-decoding.md).

Before each step, every running sequence that decodes one token at a time (not beam search)
gets a proposal (under a grammar, cut where the grammar forbids a token): with method "ngram", the tokens that followed the latest
earlier occurrence of its last n tokens in its own prompt and output (`NgramProposer`, a numpy
scan, longest n first); with method "draft_model", slots are reserved and the draft model
(`engine/draft_model.py`) draws the tokens once the step is scheduled. The scheduler adds the proposal's tokens after the sequence's last token,
the model scores every position in one pass, and the driver's sampler keeps the longest prefix the
target agrees with (`pagedllm.sampling.sampler.accept_proposal`); the slots of the rest are
rolled back (`BlockManager.rollback`).

Never slower: verifying k more tokens is worth it only when the tokens expected to be accepted
outweigh what the k extra query tokens add to the step. `SpecController` keeps the measured
chance that a proposed token matches what the target produced (also for tokens proposed but not
verified: the next token tells): for n-gram proposals by how long the match behind them is, the
first token apart from the rest (`_MatchAcceptance`); for a draft model's, per sequence. And a
cost model of a step's seconds as a
linear function of its query tokens, fitted online to the measured model time of past steps
(one line for steps of single-token decodes, one for steps with longer queries; a small token
count's own measured steps weigh more than the line there, `StepCost`). Each step it
picks the numbers of tokens that maximise expected output tokens per second of the step, down to
none: a lone sequence copying its prompt verifies many, a full batch of chat verifies nothing.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from pagedllm.config import SpeculativeConfig
from pagedllm.core import Scheduler, Sequence, SequenceGroup
from pagedllm.core.model_output import ModelRunnerOutput
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.sampling_params import SamplingType


@dataclass
class SpecDecodeStats:
    """vLLM's spec_decode counters: steps in which a sequence verified proposed tokens, those
    tokens, the accepted ones, and the accepted ones by position in the proposal."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def as_engine_stats(self) -> dict:
        """The counters under EngineStats' field names (`spec_decode_` and vLLM's names)."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
        }

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verifying sequence produced per step (accepted + the target's own)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


class NgramProposer:
    """Prompt lookup over a sequence's own tokens, on a numpy copy kept per sequence."""

    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n, self.min_n = max_n, min_n
        self._buffers: dict[int, tuple[np.ndarray, int]] = {}
        # Where each sequence's last proposal came from: (its first token's position, the
        # sequence's length then).
        self._sources: dict[int, tuple[int, int]] = {}
        # How many tokens before each sequence's last proposal's source agree with its own last
        # tokens (up to MAX_MATCH): the longer, the likelier the proposal is right.
        self.match_lengths: dict[int, int] = {}

    MAX_MATCH = 32

    def _tokens(self, seq: Sequence) -> np.ndarray:
        buf, n = self._buffers.get(seq.seq_id, (None, 0))
        total = seq.num_tokens
        if buf is None or total > buf.shape[0] or total < n:
            grown = np.empty(max(64, 2 * total), dtype=np.int64)
            keep = min(n, total) if buf is not None else 0
            if keep:
                grown[:keep] = buf[:keep]
            buf, n = grown, keep
        if n < total:
            buf[n:total] = seq.token_ids[n:total]
        self._buffers[seq.seq_id] = (buf, total)
        return buf[:total]

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k tokens following the latest earlier occurrence of the sequence's longest
        matching suffix of max_n..min_n tokens; [] when none occurs."""
        tokens = self._tokens(seq)
        length = tokens.shape[0]
        if k <= 0 or length <= self.min_n:
            return []
        # Candidates: earlier positions holding the last token, then extended backwards.
        ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
        matched = 1
        while ends.size and matched < self.max_n:
            starts = ends - matched
            ok = starts >= 0
            ok[ok] = tokens[starts[ok]] == tokens[length - 1 - matched]
            if not ok.any():
                break
            ends = ends[ok]
            matched += 1
        if matched < self.min_n or not ends.size:
            return []
        # Copying goes on where it was: the occurrence just past the last proposal's source, if
        # it matches as long a suffix, else the latest occurrence.
        end = int(ends[-1]) + 1
        source = self._sources.get(seq.seq_id)
        if source is not None:
            expected = source[0] + length - source[1]
            if expected != end and expected - 1 in set(ends[-64:].tolist()):
                end = expected
        self._sources[seq.seq_id] = (end, length)
        span = min(self.MAX_MATCH, end)
        differ = np.flatnonzero(tokens[end - span : end][::-1] != tokens[length - span :][::-1])
        self.match_lengths[seq.seq_id] = int(differ[0]) if differ.size else span
        return tokens[end : end + k].tolist()

    def forget(self, live_seq_ids: set[int]) -> None:
        for seq_id in [s for s in self._buffers if s not in live_seq_ids]:
            del self._buffers[seq_id]
            self._sources.pop(seq_id, None)
            self.match_lengths.pop(seq_id, None)


class StepCost:
    """Seconds of a step as a + b * (query tokens), fitted by exponentially weighted least squares;
    the slope is shrunk towards a prior of `PRIOR_SLOPE` of a one-token step per token until
    steps of different sizes were seen. Up to `EXACT_MAX` tokens, a step of a count that was
    measured is predicted mostly by the decayed mean of those measurements: the kernels' cost is
    not linear in a few rows (on an AVX2 CPU, products of 1-4 rows cost about one row's, from 5
    rows about twice that, and a line through it would verify 5-16 tokens where 3 pay more; with
    AVX-512 each row adds about a tenth of a one-row product up to 8 rows, then a little more)."""

    DECAY = 0.97
    PRIOR_SLOPE = 0.15
    PRIOR_WEIGHT = 8.0  # in squared tokens
    EXACT_MAX = 64
    EXACT_DECAY = 0.9
    LINE_WEIGHT = 1.0  # the line's weight beside a count's own measurements

    def __init__(self) -> None:
        self.w = self.t = self.c = self.tt = self.tc = 0.0
        self._exact: dict[int, tuple[float, float]] = {}  # tokens -> decayed (weight, seconds)

    @property
    def known(self) -> bool:
        return self.w > 0.5

    def predict(self, tokens: int) -> float:
        a, b = self.line()
        line = a + b * tokens
        weight, seconds = self._exact.get(tokens, (0.0, 0.0))
        return (seconds + self.LINE_WEIGHT * line) / (weight + self.LINE_WEIGHT)

    def predict_many(self, first: int, count: int) -> np.ndarray:
        """`predict` for the token counts first, first + 1, ..., first + count - 1."""
        a, b = self.line()
        tokens = np.arange(first, first + count)
        seconds = a + b * tokens
        for t, (weight, total) in self._exact.items():
            if first <= t < first + count:
                seconds[t - first] = (total + self.LINE_WEIGHT * seconds[t - first]) / (weight + self.LINE_WEIGHT)
        return seconds

    def observe(self, tokens: int, seconds: float) -> None:
        if self.w > 3:  # one slow step (a neighbour's burst, a first call) moves the line little
            seconds = min(seconds, 2 * self.predict(tokens))
        d = self.DECAY
        self.w, self.t, self.c = d * self.w + 1, d * self.t + tokens, d * self.c + seconds
        self.tt, self.tc = d * self.tt + tokens * tokens, d * self.tc + tokens * seconds
        if tokens <= self.EXACT_MAX:
            weight, total = self._exact.get(tokens, (0.0, 0.0))
            self._exact[tokens] = (self.EXACT_DECAY * weight + 1, self.EXACT_DECAY * total + seconds)

    def line(self) -> tuple[float, float]:
        mean_t, mean_c = self.t / self.w, self.c / self.w
        prior = self.PRIOR_SLOPE * mean_c / max(1.0, mean_t)
        var = self.tt - self.t * mean_t
        cov = self.tc - self.t * mean_c
        slope = max(0.0, (cov + self.PRIOR_WEIGHT * prior) / (var + self.PRIOR_WEIGHT))
        return max(mean_c - slope * mean_t, 0.0), slope


@dataclass
class _Acceptance:
    """Decayed counts of proposed tokens that matched the target's and of first mismatches: a
    geometric model whose rate is the chance that the next proposed token is accepted."""

    matched: float = 0.0
    mismatched: float = 0.0

    DECAY = 0.9

    def observe(self, matched: int, mismatch: bool) -> None:
        self.matched = self.DECAY * self.matched + matched
        self.mismatched = self.DECAY * self.mismatched + mismatch

    def rate(self, prior: float) -> float:
        return (self.matched + 2 * prior) / (self.matched + self.mismatched + 2)


# Upper bounds of the match-length buckets (`NgramProposer.match_lengths`): 1, 2, 3-4, 5-8, 9-16
# and more. Each bucket's prior chance that the first proposed token is accepted, and that each
# later one is after an accepted one, as measured on the default model over bench spec's grounded
# and chat prompts and 16 grounded requests (first token: 0.14-0.26 after a 1-token match, about
# 0.5 after 2, 0.85 after 5-8, 0.95 and more past 8; a proposal whose first token is accepted
# then runs 4-36 tokens on).
MATCH_BUCKETS = (1, 2, 4, 8, 16)
FIRST_PRIORS = (0.2, 0.5, 0.65, 0.85, 0.93, 0.97)
NEXT_PRIORS = (0.8, 0.8, 0.85, 0.9, 0.93, 0.97)


def match_bucket(match_length: int) -> int:
    return bisect.bisect_left(MATCH_BUCKETS, match_length)


@dataclass
class _MatchAcceptance:
    """One match-length bucket's decayed counts: proposals, those whose first token was accepted,
    and after an accepted first token, further tokens matched and first mismatches. Acceptance is
    not geometric from the first token: a proposal is either wrong at once (the text diverged
    from its source) or copies on for many tokens; so the first token and the rest get a rate
    each."""

    first_prior: float
    next_prior: float
    proposals: float = 0.0
    first_accepted: float = 0.0
    next_matched: float = 0.0
    next_mismatched: float = 0.0

    DECAY = 0.95
    PRIOR_WEIGHT = 2.0

    def observe(self, matched: int, known: int) -> None:
        d = self.DECAY
        self.proposals = d * self.proposals + 1
        self.first_accepted = d * self.first_accepted + (matched > 0)
        self.next_matched, self.next_mismatched = d * self.next_matched, d * self.next_mismatched
        if matched:
            self.next_matched += matched - 1
            self.next_mismatched += matched < known

    def gains(self, num_tokens: int) -> np.ndarray:
        """The chance that each of the first `num_tokens` proposed tokens is accepted (with all
        before it): first * next ** (j - 1)."""
        w = self.PRIOR_WEIGHT
        first = (self.first_accepted + w * self.first_prior) / (self.proposals + w)
        rest = (self.next_matched + w * self.next_prior) / (self.next_matched + self.next_mismatched + w)
        return first * rest ** np.arange(num_tokens, dtype=np.float64)


class SpecController:
    """How many proposed tokens each sequence verifies this step (the module docstring)."""

    def __init__(self, adaptive: bool = True, min_prior: float = 0.3) -> None:
        self.adaptive = adaptive
        # A sequence not measured yet is assumed to accept as all have (at most 0.9), and at
        # least `min_prior`: n-gram proposals exist only where the sequence repeats itself, which
        # says something of a new one; a draft model proposes for every sequence, so it starts
        # from the measured rate alone (0).
        self.min_prior = min_prior
        self.decode_cost = StepCost()  # steps of single-token queries only
        # Steps of decodes and verifications (no prompt chunk: a prompt's first step costs
        # differently, and is never a choice this controller makes).
        self.verify_cost = StepCost()
        self.acceptance: dict[int, _Acceptance] = {}
        self.overall = _Acceptance()
        # n-gram proposals that state their match length: shared by all sequences, by bucket.
        self.by_match = [_MatchAcceptance(f, n) for f, n in zip(FIRST_PRIORS, NEXT_PRIORS)]

    def cost(self, tokens: int, multi: bool) -> float:
        """Predicted seconds of a step of `tokens` query tokens: of single-token decodes only,
        or (`multi`) with longer queries. Until verifications were measured, as decodes (an
        optimistic start, so that they are tried and measured)."""
        model = self.verify_cost if multi and self.verify_cost.known else self.decode_cost
        return model.predict(tokens) if model.known else 1.0

    def rate(self, seq_id: int) -> float:
        prior = min(0.9, max(self.min_prior, self.overall.rate(0.5)))
        acc = self.acceptance.get(seq_id)
        return acc.rate(prior) if acc is not None else prior

    def gains(self, seq_id: int, num_tokens: int, match_length: int | None = None) -> np.ndarray:
        """The chance that each of a proposal's first `num_tokens` tokens is accepted (with all
        before it): by its match length's bucket where the proposer gave one, else the
        sequence's geometric rate (rate ** j)."""
        if match_length is not None:
            return self.by_match[match_bucket(match_length)].gains(num_tokens)
        return self.rate(seq_id) ** np.arange(1, num_tokens + 1, dtype=np.float64)

    def choose(self, proposals: dict[int, list[int]], base_tokens: int, base_outputs: int, base_multi: bool,
               budget: int, match_lengths: dict[int, int] | None = None) -> dict[int, int]:
        """Tokens to verify per sequence, given every proposal (with its match length, where
        known) and the step's other work (`base_tokens` query tokens producing `base_outputs`
        tokens). Greedy on the marginal gain, which falls with each token a sequence adds,
        keeping the best total."""
        if not self.adaptive:
            chosen, left = {}, budget
            for seq_id, proposal in proposals.items():
                chosen[seq_id] = min(len(proposal), max(0, left))
                left -= chosen[seq_id]
            return chosen
        match_lengths = match_lengths or {}
        # The marginal gains of every proposed token, best first (ties: the lower sequence id,
        # then the earlier token), as far as the budget goes: the order in which adding one
        # token at a time, best marginal gain first, takes them.
        seq_ids = [s for s, p in proposals.items() for _ in range(len(p))]
        positions = [j for p in proposals.values() for j in range(1, len(p) + 1)]
        gains = np.concatenate([self.gains(s, len(p), match_lengths.get(s)) for s, p in proposals.items()] or [[]])
        order = np.lexsort((positions, seq_ids, -gains))[: max(0, budget)]
        chosen = dict.fromkeys(proposals, 0)
        if not order.size:
            return chosen
        base_value = base_outputs / self.cost(base_tokens, base_multi)
        model = self.verify_cost if self.verify_cost.known else self.decode_cost
        costs = model.predict_many(base_tokens + 1, order.size) if model.known else np.ones(order.size)
        values = np.cumsum(np.concatenate(([float(base_outputs)], gains[order])))[1:] / costs
        best = int(np.argmax(values))  # the first of the best
        if values[best] > base_value:
            for i in order[: best + 1].tolist():
                chosen[seq_ids[i]] += 1
        return chosen

    def observe_step(self, tokens: int, multi: bool, seconds: float) -> None:
        """A step of decodes (`multi`: and verifications) took `seconds`."""
        (self.verify_cost if multi else self.decode_cost).observe(tokens, seconds)

    def observe_tokens(self, seq_id: int, proposal: list[int], produced: list[int],
                       match_length: int | None = None) -> None:
        """What the target produced after a proposal, verified or not, tells how far it matched."""
        known = min(len(proposal), len(produced))
        if not known:
            return
        matched = 0
        while matched < known and proposal[matched] == produced[matched]:
            matched += 1
        mismatch = matched < known
        self.acceptance.setdefault(seq_id, _Acceptance()).observe(matched, mismatch)
        self.overall.observe(matched, mismatch)
        if match_length is not None:
            self.by_match[match_bucket(match_length)].observe(matched, known)

    def forget(self, live_seq_ids: set[int]) -> None:
        for seq_id in [s for s in self.acceptance if s not in live_seq_ids]:
            del self.acceptance[seq_id]


def _allowed_prefix(seq: Sequence, proposal: list[int]) -> list[int]:
    """A constrained sequence's proposal, cut where its grammar forbids the next token (the
    sampler masks each verified position by the grammar's state there, so a forbidden token
    would only be rejected)."""
    constraint = seq.constraint.fork()
    for n, token in enumerate(proposal):
        if not constraint.accept_token(token):
            return proposal[:n]
    return proposal


class Speculator:
    """Proposes before each step and learns after it (`LLMEngine.step` calls both)."""

    FORGET_EVERY = 64  # steps between pruning the state of sequences that are gone
    # After a step that verified nothing, with several sequences running, the n-gram lookup runs
    # for one sequence in PROBE_EVERY each step (in turn): enough to keep measuring acceptance and
    # to find a sequence that starts copying within a few steps, at a quarter of the lookups'
    # cost (about 1% of a step of 64 sequences that never verify).
    PROBE_EVERY = 4

    def __init__(self, config: SpeculativeConfig, max_model_len: int, max_num_batched_tokens: int, draft=None) -> None:
        self.config = config
        self.draft = draft  # a `DraftModel` for method "draft_model"; None: n-gram proposals
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.proposer = NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
        self.controller = SpecController(config.adaptive, min_prior=0.0 if draft is not None else 0.3)
        self.stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        self._proposals: dict[int, list[int]] = {}  # this step's full proposals, by sequence
        self._match_lengths: dict[int, int] = {}  # and the n-gram match length of each
        self._steps = 0
        self._verified_last = True  # whether the last step verified any proposed token

    def _room(self, group: SequenceGroup, seq: Sequence) -> int:
        """Proposed tokens the sequence may verify: within num_speculative_tokens, its max_tokens
        (the target's own token follows them) and the context."""
        params = group.sampling_params
        room = self.max_model_len - seq.num_tokens
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - seq.num_output_tokens - 1)
        return min(self.config.num_speculative_tokens, room)

    @staticmethod
    def _eligible(group: SequenceGroup) -> bool:
        params = group.sampling_params
        if params.sampling_type is SamplingType.BEAM:
            return False  # beam search runs without speculation
        return group.forked or params.best_of == 1

    def propose(self, scheduler: Scheduler) -> None:
        """Set `draft_token_ids` on the running sequences that will verify proposed tokens."""
        self._proposals, self._match_lengths = {}, {}
        seqs: dict[int, Sequence] = {}
        probing = (self.config.adaptive and self.draft is None and not self._verified_last
                   and scheduler.num_running_seqs > 1)
        self._verified_last = False
        base_tokens = base_outputs = 0
        for group in scheduler.running:
            eligible = self._eligible(group)
            for seq in group.unfinished_seqs():
                seq.draft_token_ids = []
                left = seq.num_uncomputed_tokens
                base_tokens += left
                if left != 1:
                    continue
                base_outputs += 1
                if not eligible or (seq.constraint is not None and self.draft is not None):
                    continue
                if probing and seq.seq_id % self.PROBE_EVERY != self._steps % self.PROBE_EVERY:
                    continue
                room = self._room(group, seq)
                if self.draft is not None:  # slots reserved now, tokens drawn after scheduling (`fill`)
                    proposal = [0] * max(room, 0)
                else:
                    proposal = self.proposer.propose(seq, room) if room > 0 else []
                    if proposal and seq.constraint is not None:
                        proposal = _allowed_prefix(seq, proposal)
                if proposal:
                    self._proposals[seq.seq_id] = proposal
                    seqs[seq.seq_id] = seq
                    match_length = self.proposer.match_lengths.get(seq.seq_id) if self.draft is None else None
                    if match_length is not None:
                        self._match_lengths[seq.seq_id] = match_length
        if not self._proposals:
            return
        prompt_tokens = self._prompt_work(scheduler, base_tokens - base_outputs)
        limit = scheduler.prompt_chunk_limit
        if self.config.adaptive and limit is not None and prompt_tokens > limit:
            # The step-time budget is holding prompts back: verified tokens would lengthen the
            # steps that admit them (measured, 64 grounded requests at once: half as many
            # sequences ran together, 0.89-0.92x the plain engine's rate).
            return
        budget = self.max_num_batched_tokens
        # Running sequences come first in the scheduler's budget, so without the adaptive choice
        # proposals may take what prompts would have had.
        left = budget - min(budget, base_outputs + prompt_tokens if self.config.adaptive else base_outputs)
        # The choice weighs what verifying adds against the step's decodes alone: a prompt chunk
        # in the step costs the same with or without it, and counted in the step's time it would
        # make every verified token look cheap.
        chosen = self.controller.choose(self._proposals, base_outputs, base_outputs, False, left, self._match_lengths)
        for seq_id, k in chosen.items():
            if k:
                seqs[seq_id].draft_token_ids = self._proposals[seq_id][:k]
                self._verified_last = True

    def _prompt_work(self, scheduler: Scheduler, running_prompt_tokens: int) -> int:
        """Prompt tokens the next step could compute: the running groups' rest of their prompts
        and the waiting groups' that `max_num_seqs` leaves seats for, oldest first."""
        tokens, seats = running_prompt_tokens, scheduler.num_running_seqs
        for group in scheduler.waiting:
            seats += max(group.num_unfinished_seqs, group.sampling_params.best_of)
            if seats > scheduler.config.max_num_seqs or tokens >= self.max_num_batched_tokens:
                break  # no seat, or already more than a step takes: a long queue is not walked
            tokens += sum(seq.num_uncomputed_tokens for seq in group.unfinished_seqs())
        return tokens

    def fill(self, scheduled: SchedulerOutput, seqs: dict[int, Sequence]) -> None:
        """With a draft model: draw the proposed tokens into the scheduled step (the draft runs
        only for the sequences that speculate in it, and applies every step's swaps and copies)."""
        if self.draft is None:
            return
        self.draft.propose(scheduled, seqs)
        self._proposals = {item.seq_id: item.draft_token_ids for item in scheduled.seqs if item.draft_token_ids}

    def shutdown(self) -> None:
        if self.draft is not None:
            self.draft.shutdown()

    def observe(self, scheduled: SchedulerOutput, result: ModelRunnerOutput, seconds: float) -> None:
        """After a step: its cost, the acceptance of each proposal, the counters."""
        if self.draft is not None:
            self.draft.observe(scheduled, result)
        if all(len(item.token_ids) == 1 + len(item.draft_token_ids) for item in scheduled.seqs):  # no prompt chunk
            multi = any(item.draft_token_ids for item in scheduled.seqs)
            self.controller.observe_step(scheduled.num_batched_tokens, multi, seconds)
        per_pos = self.stats.num_accepted_tokens_per_pos
        live = set()
        for item in scheduled.seqs:
            live.add(item.seq_id)
            step = result.outputs.get(item.seq_id)
            if step is None or not step.samples:
                continue
            num_drafts = len(item.draft_token_ids)
            if num_drafts:
                num_accepted = len(step.accepted)
                self.stats.num_drafts += 1
                self.stats.num_draft_tokens += num_drafts
                self.stats.num_accepted_tokens += num_accepted
                for pos in range(num_accepted):
                    per_pos[pos] += 1
            proposal = self._proposals.get(item.seq_id)
            if proposal:
                produced = [t.token_id for t in step.accepted] + [step.samples[0].token_id]
                self.controller.observe_tokens(item.seq_id, proposal, produced, self._match_lengths.get(item.seq_id))
        self._steps += 1
        if self._steps % self.FORGET_EVERY == 0:
            self.proposer.forget(live)
            self.controller.forget(live)
