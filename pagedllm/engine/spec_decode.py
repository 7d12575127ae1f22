"""Speculative decoding's engine side: proposals, the per-step choice of how many to verify (its
model in engine/spec_controller.py), and the counters (docs/speculative-decoding.md).

Before each step, every running sequence that decodes one token at a time (not beam search)
gets a proposal (under a grammar, cut where the grammar forbids a token): with method "ngram",
the tokens that followed the latest earlier occurrence of its last n tokens in its own prompt and
output (`NgramProposer`, a numpy scan, longest n first); with method "draft_model", slots are
reserved and the draft model (`engine/draft_model.py`) draws the tokens once the step is
scheduled. The scheduler adds the proposal's tokens after the sequence's last token, the model
scores every position in one pass, and the driver's sampler keeps the longest prefix the
target agrees with (`pagedllm.sampling.sampler.accept_proposal`); the slots of the rest are
rolled back (`BlockManager.rollback`).

Never slower: each step `SpecController` (engine/spec_controller.py) picks how many proposed
tokens each sequence verifies, from measured acceptance and step costs, down to none: a lone
sequence copying its prompt verifies many, a full batch of chat verifies nothing. After a step
that verified nothing, with several sequences running, the n-gram lookup runs for one sequence in
`Speculator.PROBE_EVERY` each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedllm.config import SpeculativeConfig
from pagedllm.core import Scheduler, Sequence, SequenceGroup
from pagedllm.core.model_output import ModelRunnerOutput
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.engine.spec_controller import SpecController
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
    """Proposes before each step and learns after it (`EngineCore.step` calls both)."""

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
        if params.sampling_type is SamplingType.BEAM or group.pooling_params is not None:
            return False  # beam search runs without speculation; a pooling request generates nothing
        return group.forked or params.best_of == 1

    def propose(self, scheduler: Scheduler, prompt_chunk_limit: int | None = None) -> dict[int, list[int]]:
        """The proposed tokens each running sequence will verify in the next step, by sequence id
        (for `Scheduler.update_draft_token_ids`); `prompt_chunk_limit` is the step-time budget's."""
        self._proposals, self._match_lengths = {}, {}
        probing = (self.config.adaptive and self.draft is None and not self._verified_last
                   and scheduler.num_running_seqs > 1)
        self._verified_last = False
        base_tokens = base_outputs = 0
        for group in scheduler.running:
            eligible = self._eligible(group)
            for seq in group.unfinished_seqs():
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
                    if proposal and seq.seq_id in self.proposer.match_lengths:
                        self._match_lengths[seq.seq_id] = self.proposer.match_lengths[seq.seq_id]
                if proposal:
                    self._proposals[seq.seq_id] = proposal
        if not self._proposals:
            return {}
        prompt_tokens = self._prompt_work(scheduler, base_tokens - base_outputs)
        if self.config.adaptive and prompt_chunk_limit is not None and prompt_tokens > prompt_chunk_limit:
            # The step-time budget is holding prompts back: verified tokens would lengthen the
            # steps that admit them (measured, 64 grounded requests at once: half as many
            # sequences ran together, 0.89-0.92x the plain engine's rate).
            return {}
        budget = self.max_num_batched_tokens
        # Running sequences come first in the scheduler's budget, so without the adaptive choice
        # proposals may take what prompts would have had.
        left = budget - min(budget, base_outputs + prompt_tokens if self.config.adaptive else base_outputs)
        # The choice weighs what verifying adds against the step's decodes alone: a prompt chunk
        # in the step costs the same with or without it, and counted in the step's time it would
        # make every verified token look cheap.
        chosen = self.controller.choose(self._proposals, base_outputs, base_outputs, False, left, self._match_lengths)
        drafts = {seq_id: self._proposals[seq_id][:k] for seq_id, k in chosen.items() if k}
        self._verified_last = bool(drafts)
        return drafts

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
