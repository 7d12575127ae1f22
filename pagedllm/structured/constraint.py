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


def _word_bit(token_id: int) -> int:
    bit = 1 << (token_id & 31)
    return bit - 2**32 if bit >= 2**31 else bit  # as two's complement int32


def _clear_bit(bitmask: torch.Tensor, index: int, token_id: int) -> None:
    bitmask[index, token_id >> 5] &= ~_word_bit(token_id)


def _set_bit(bitmask: torch.Tensor, index: int, token_id: int) -> None:
    bitmask[index, token_id >> 5] |= _word_bit(token_id)


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


class ReasoningGate:
    """Holds a sequence's grammar back while a reasoning model thinks (as vLLM does): until the
    output holds `end_token_ids` (the end tag, `</think>`) the grammar neither masks tokens nor
    sees them, and from the token after, it starts from its initial state. With
    `start_token_id`, thinking has not begun: the first token may open it (that token is allowed
    besides the grammar's), and any other first token starts the grammar at once."""

    __slots__ = ("end_token_ids", "start_token_id", "opening", "tail")

    def __init__(self, end_token_ids: Sequence[int], start_token_id: int | None = None) -> None:
        self.end_token_ids = tuple(end_token_ids)
        self.start_token_id = start_token_id
        self.opening = start_token_id is not None  # the first token is still to come
        self.tail: list[int] = []  # the output's last tokens, as many as the end tag has

    def fork(self) -> "ReasoningGate":
        gate = ReasoningGate(self.end_token_ids, self.start_token_id)
        gate.opening, gate.tail = self.opening, list(self.tail)
        return gate

    def ends_with(self, token_id: int) -> bool:
        """Take a thinking token; True if it completes the end tag."""
        self.tail.append(token_id)
        del self.tail[: -len(self.end_token_ids)]
        return tuple(self.tail) == self.end_token_ids


class SequenceConstraint:
    """A grammar's matcher state (or none) and the request's `TokenControls` (or none), with the
    output's last tokens that its bad words' prefixes need, and the `ReasoningGate` that holds
    the grammar back while the model thinks (or none: the grammar applies now). Implements the
    `TokenConstraint` protocol of `core.sequence`. It holds the compiled grammar too, so that the
    engine's count of live grammars (weak references to them) keeps it until the last sequence
    using it is gone."""

    __slots__ = ("matcher", "controls", "recent", "compiled", "gate")

    def __init__(
        self,
        matcher: "xgr.GrammarMatcher | None",
        controls: TokenControls | None,
        recent: list[int] | None = None,
        compiled: "xgr.CompiledGrammar | None" = None,
        gate: ReasoningGate | None = None,
    ) -> None:
        self.compiled = compiled
        self.matcher = matcher
        self.controls = controls if controls is not None and not controls.empty else None  # shared between forks
        self.recent = recent if recent is not None else []
        self.gate = gate if matcher is not None else None  # only a grammar waits for the reasoning

    @classmethod
    def create(
        cls,
        compiled: "xgr.CompiledGrammar | None",
        vocab_size: int,
        allowed_token_ids: list[int] | None = None,
        bad_words: Sequence[Sequence[int]] = (),
        controls: TokenControls | None = None,
        gate: ReasoningGate | None = None,
    ) -> "SequenceConstraint":
        matcher = None
        if compiled is not None:
            import xgrammar

            matcher = xgrammar.GrammarMatcher(compiled)
        if controls is None:
            controls = TokenControls(vocab_size, allowed_token_ids, bad_words)
        return cls(matcher, controls, compiled=compiled, gate=gate)

    def accept_token(self, token_id: int) -> bool:
        history = self.controls.history if self.controls is not None else 0
        if history:
            self.recent.append(token_id)
            del self.recent[:-history]
        gate = self.gate
        if gate is not None:
            if gate.opening:  # the first token: thinking opens, or the grammar takes this token
                gate.opening = False
                if token_id == gate.start_token_id:
                    return True
                self.gate = None
            else:
                if gate.ends_with(token_id):
                    self.gate = None  # the grammar starts with the next token
                return True
        if self.matcher is None or self.matcher.is_terminated():
            return True
        return self.matcher.accept_token(token_id)

    def fork(self) -> "SequenceConstraint":
        matcher = self.matcher.fork() if self.matcher is not None else None
        gate = self.gate.fork() if self.gate is not None else None
        return SequenceConstraint(matcher, self.controls, list(self.recent), self.compiled, gate)

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        """Clear the bits of row `index` (all set on entry) for the tokens not allowed next."""
        gate = self.gate
        if self.matcher is not None and not self.matcher.is_terminated() and (gate is None or gate.opening):
            self.matcher.fill_next_token_bitmask(bitmask, index)
            if gate is not None:  # the first token may open thinking instead
                _set_bit(bitmask, index, gate.start_token_id)
        if self.controls is not None:
            self.controls.fill(bitmask, index, self.recent)


def fill_step_bitmasks(rows: list[tuple[object, SequenceConstraint]], vocab_size: int) -> None:
    """Give each scheduled sampling item (a `ScheduledSequence`) its row of this step's bitmask."""
    bitmask = torch.full((len(rows), num_words(vocab_size)), -1, dtype=torch.int32)
    for index, (_, constraint) in enumerate(rows):
        constraint.fill(bitmask, index)
    for index, (item, _) in enumerate(rows):
        item.token_bitmask = bitmask[index].clone()  # its own storage: the message may be pickled
