"""One sequence's token constraints, and the per-step bitmask of the tokens each may draw.

A bitmask packs 32 tokens per int32 word (xgrammar's layout): token t is allowed when bit
t % 32 of word t // 32 is set. Each step the engine gives every constrained sampling sequence
one row, all-ones to start; the grammar matcher writes its row, then allowed_token_ids and
bad_words clear bits in it. The sampler applies all rows to the logits in one call."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # xgrammar is imported only with a compiled grammar (see the package's doc)
    import xgrammar as xgr

_SHIFTS = torch.arange(32, dtype=torch.int64)


def num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def pack_token_ids(token_ids: Iterable[int], vocab_size: int) -> torch.Tensor:
    """A bitmask row (int32 [ceil(vocab / 32)]) with exactly `token_ids` set."""
    bits = torch.zeros(num_words(vocab_size) * 32, dtype=torch.bool)
    bits[list(token_ids)] = True
    words = (bits.view(-1, 32).to(torch.int64) << _SHIFTS).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # as two's complement int32


def _clear_bit(bitmask: torch.Tensor, index: int, token_id: int) -> None:
    bit = 1 << (token_id & 31)
    if bit >= 2**31:
        bit -= 2**32
    bitmask[index, token_id >> 5] &= ~bit


class SequenceConstraint:
    """A grammar's matcher state (or none), a fixed mask (allowed_token_ids less the one-token bad
    words) and the longer bad words, whose last token is banned whenever the output so far ends
    with the rest of the word. Implements the `TokenConstraint` protocol of `core.sequence`."""

    __slots__ = ("matcher", "fixed_mask", "bad_words", "recent", "_history")

    def __init__(
        self,
        matcher: "xgr.GrammarMatcher | None",
        fixed_mask: torch.Tensor | None,
        bad_words: tuple[tuple[int, ...], ...],
        recent: list[int] | None = None,
    ) -> None:
        self.matcher = matcher
        self.fixed_mask = fixed_mask  # shared between forks: never written
        self.bad_words = bad_words
        self._history = max((len(w) for w in bad_words), default=1) - 1  # output tokens a prefix match needs
        self.recent = recent if recent is not None else []

    @classmethod
    def create(
        cls,
        compiled: "xgr.CompiledGrammar | None",
        vocab_size: int,
        allowed_token_ids: list[int] | None = None,
        bad_words: Sequence[Sequence[int]] = (),
    ) -> "SequenceConstraint":
        matcher = None
        if compiled is not None:
            import xgrammar

            matcher = xgrammar.GrammarMatcher(compiled)
        single = {w[0] for w in bad_words if len(w) == 1}
        longer = tuple(tuple(w) for w in bad_words if len(w) > 1)
        fixed = None
        if allowed_token_ids is not None or single:
            allowed = set(allowed_token_ids) if allowed_token_ids is not None else set(range(vocab_size))
            fixed = pack_token_ids(sorted(allowed - single), vocab_size)
        return cls(matcher, fixed, longer)

    def accept_token(self, token_id: int) -> bool:
        if self._history:
            self.recent.append(token_id)
            del self.recent[: -self._history]
        if self.matcher is None or self.matcher.is_terminated():
            return True
        return self.matcher.accept_token(token_id)

    def fork(self) -> "SequenceConstraint":
        matcher = self.matcher.fork() if self.matcher is not None else None
        return SequenceConstraint(matcher, self.fixed_mask, self.bad_words, list(self.recent))

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        """Clear the bits of row `index` (all set on entry) for the tokens not allowed next."""
        if self.matcher is not None and not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, index)
        if self.fixed_mask is not None:
            bitmask[index] &= self.fixed_mask
        for word in self.bad_words:
            prefix = word[:-1]
            if len(self.recent) >= len(prefix) and tuple(self.recent[len(self.recent) - len(prefix) :]) == prefix:
                _clear_bit(bitmask, index, word[-1])


def fill_step_bitmasks(rows: list[tuple[object, SequenceConstraint]], vocab_size: int) -> None:
    """Give each scheduled sampling item (a `ScheduledSequence`) its row of this step's bitmask."""
    bitmask = torch.full((len(rows), num_words(vocab_size)), -1, dtype=torch.int32)
    for index, (_, constraint) in enumerate(rows):
        constraint.fill(bitmask, index)
    for index, (item, _) in enumerate(rows):
        item.token_bitmask = bitmask[index].clone()  # its own storage: the message may be pickled
