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
    return _pack_bits(bits)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    words = (bits.view(-1, 32).to(torch.int64) << _SHIFTS).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # as two's complement int32


def _clear_bit(bitmask: torch.Tensor, index: int, token_id: int) -> None:
    bit = 1 << (token_id & 31)
    if bit >= 2**31:
        bit -= 2**32
    bitmask[index, token_id >> 5] &= ~bit


class TokenControls:
    """A request's allowed_token_ids and bad words, prepared once per request (off the engine's
    thread) and shared by its sequences: a fixed mask (allowed_token_ids less the one-token bad
    words) and, for longer bad words, a table from the tokens before each word's last one to the
    last tokens they ban. A step looks up one tuple per distinct prefix length, however many
    words there are."""

    __slots__ = ("fixed_mask", "by_prefix", "history")

    def __init__(self, vocab_size: int, allowed_token_ids: list[int] | None = None, bad_words: Sequence[Sequence[int]] = ()) -> None:
        single = [w[0] for w in bad_words if len(w) == 1]
        self.by_prefix: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for word in bad_words:
            if len(word) > 1:
                self.by_prefix.setdefault(len(word) - 1, {}).setdefault(tuple(word[:-1]), []).append(word[-1])
        self.history = max(self.by_prefix, default=0)  # output tokens a prefix match needs
        self.fixed_mask: torch.Tensor | None = None
        if allowed_token_ids is not None or single:
            bits = torch.zeros(num_words(vocab_size) * 32, dtype=torch.bool)
            if allowed_token_ids is not None:
                bits[list(allowed_token_ids)] = True
            else:
                bits[:vocab_size] = True
            bits[single] = False
            self.fixed_mask = _pack_bits(bits)

    @property
    def empty(self) -> bool:
        return self.fixed_mask is None and not self.by_prefix

    def fill(self, bitmask: torch.Tensor, index: int, recent: list[int]) -> None:
        if self.fixed_mask is not None:
            bitmask[index] &= self.fixed_mask
        for length, table in self.by_prefix.items():
            if len(recent) >= length:
                for token_id in table.get(tuple(recent[len(recent) - length :]), ()):
                    _clear_bit(bitmask, index, token_id)


class SequenceConstraint:
    """A grammar's matcher state (or none) and the request's `TokenControls` (or none), with the
    output's last tokens that its bad words' prefixes need. Implements the `TokenConstraint`
    protocol of `core.sequence`. It holds the compiled grammar too, so that the engine's count of
    live grammars (weak references to them) keeps it until the last sequence using it is gone."""

    __slots__ = ("matcher", "controls", "recent", "compiled")

    def __init__(
        self,
        matcher: "xgr.GrammarMatcher | None",
        controls: TokenControls | None,
        recent: list[int] | None = None,
        compiled: "xgr.CompiledGrammar | None" = None,
    ) -> None:
        self.compiled = compiled
        self.matcher = matcher
        self.controls = controls if controls is not None and not controls.empty else None  # shared between forks
        self.recent = recent if recent is not None else []

    @classmethod
    def create(
        cls,
        compiled: "xgr.CompiledGrammar | None",
        vocab_size: int,
        allowed_token_ids: list[int] | None = None,
        bad_words: Sequence[Sequence[int]] = (),
        controls: TokenControls | None = None,
    ) -> "SequenceConstraint":
        matcher = None
        if compiled is not None:
            import xgrammar

            matcher = xgrammar.GrammarMatcher(compiled)
        if controls is None:
            controls = TokenControls(vocab_size, allowed_token_ids, bad_words)
        return cls(matcher, controls, compiled=compiled)

    def accept_token(self, token_id: int) -> bool:
        history = self.controls.history if self.controls is not None else 0
        if history:
            self.recent.append(token_id)
            del self.recent[:-history]
        if self.matcher is None or self.matcher.is_terminated():
            return True
        return self.matcher.accept_token(token_id)

    def fork(self) -> "SequenceConstraint":
        matcher = self.matcher.fork() if self.matcher is not None else None
        return SequenceConstraint(matcher, self.controls, list(self.recent), self.compiled)

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        """Clear the bits of row `index` (all set on entry) for the tokens not allowed next."""
        if self.matcher is not None and not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, index)
        if self.controls is not None:
            self.controls.fill(bitmask, index, self.recent)


def fill_step_bitmasks(rows: list[tuple[object, SequenceConstraint]], vocab_size: int) -> None:
    """Give each scheduled sampling item (a `ScheduledSequence`) its row of this step's bitmask."""
    bitmask = torch.full((len(rows), num_words(vocab_size)), -1, dtype=torch.int32)
    for index, (_, constraint) in enumerate(rows):
        constraint.fill(bitmask, index)
    for index, (item, _) in enumerate(rows):
        item.token_bitmask = bitmask[index].clone()  # its own storage: the message may be pickled
