"""How many proposed tokens each sequence verifies in a step (docs/speculative-decoding.md,
"Never slower"): verifying k more tokens pays only when the tokens expected to be accepted
outweigh what the k extra query tokens add to the step.

`StepCost` models a step's seconds from its query tokens, fitted online to measured steps.
Acceptance is measured from what the target produced after each proposal (also for tokens
proposed but not verified: the next token tells): for n-gram proposals by how long the match
behind them is, the first token apart from the rest (`_MatchAcceptance`); for a draft model's,
per sequence, one geometric rate (`_Acceptance`). `SpecController.choose` adds proposed tokens
best marginal gain first and keeps the number that maximises expected output tokens per second
of the step's decodes, down to none. Plain numbers and numpy only: no model, no engine.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


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
# later one is after an accepted one. Measured on the default model by `benchmarks/spec_replay.py
# --lookup-min 1` (proposals at every position of bench spec's 12 greedy outputs): the first token
# is right 18% of the time after a 1-token match, 58% after 2, 69% after 3-4, 89% after 5-8, 94%
# after 9-16, 98% past 16; a proposal whose first token is right then runs on for 3.8-11.9 tokens
# on average (of at most 16).
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

    def first(self) -> float:
        """The chance that a proposal's first token is accepted."""
        return (self.first_accepted + self.PRIOR_WEIGHT * self.first_prior) / (self.proposals + self.PRIOR_WEIGHT)

    def gains(self, num_tokens: int, first: float | None = None) -> np.ndarray:
        """The chance that each of the first `num_tokens` proposed tokens is accepted (with all
        before it): first * next ** (j - 1); `first` replaces the bucket's own chance."""
        w = self.PRIOR_WEIGHT
        rest = (self.next_matched + w * self.next_prior) / (self.next_matched + self.next_mismatched + w)
        return (self.first() if first is None else first) * rest ** np.arange(num_tokens, dtype=np.float64)


@dataclass
class _FirstTokenRecord:
    """One sequence's n-gram proposals: decayed counts of first tokens accepted and of those its
    buckets expected. Their ratio corrects the buckets' chance for this sequence: the buckets
    are shared by every sequence of the engine, and a sequence's text (a chat answer after a run
    of code edits) may repeat its context far less than theirs did."""

    accepted: float = 0.0
    expected: float = 0.0

    DECAY = 0.9
    WEIGHT = 2.0  # the buckets' word, in proposals
    MAX_FIRST = 0.99

    def observe(self, accepted: bool, expected: float) -> None:
        self.accepted = self.DECAY * self.accepted + accepted
        self.expected = self.DECAY * self.expected + expected

    def correct(self, first: float) -> float:
        return min(self.MAX_FIRST, first * (self.accepted + self.WEIGHT) / (self.expected + self.WEIGHT))


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
        # n-gram proposals that state their match length: shared by all sequences, by bucket,
        # and each sequence's record against its buckets' expectation.
        self.by_match = [_MatchAcceptance(f, n) for f, n in zip(FIRST_PRIORS, NEXT_PRIORS)]
        self.first_records: dict[int, _FirstTokenRecord] = {}

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
        before it): by its match length's bucket where the proposer gave one (the first token's
        chance corrected by the sequence's record), else the sequence's geometric rate (rate ** j)."""
        if match_length is not None:
            bucket = self.by_match[match_bucket(match_length)]
            record = self.first_records.get(seq_id)
            return bucket.gains(num_tokens, record.correct(bucket.first()) if record is not None else None)
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
        if match_length is not None:  # an n-gram proposal: its bucket and the record are what `gains` reads
            bucket = self.by_match[match_bucket(match_length)]
            self.first_records.setdefault(seq_id, _FirstTokenRecord()).observe(matched > 0, bucket.first())
            bucket.observe(matched, known)
            return
        mismatch = matched < known
        self.acceptance.setdefault(seq_id, _Acceptance()).observe(matched, mismatch)
        self.overall.observe(matched, mismatch)

    def forget(self, live_seq_ids: set[int]) -> None:
        for records in (self.acceptance, self.first_records):
            for seq_id in [s for s in records if s not in live_seq_ids]:
                del records[seq_id]
