"""Sequences and sequence groups: the request lifecycle's state, as plain Python objects.

A `Sequence` is one stream of tokens (a prompt and what has been generated after it). A
`SequenceGroup` is one request: its sequences (one, or several for parallel sampling and beam
search) are scheduled, preempted and resumed together.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.outputs import PositionLogprobs, RequestMetrics
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self._value_ in _FINISHED  # (by value: a str's hash is cached, an Enum's is a Python call)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


_FINISHED = frozenset(
    status.value
    for status in (
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH,
        SequenceStatus.FINISHED_ABORTED,
        SequenceStatus.FINISHED_ERROR,
    )
)


class Detokenizer(Protocol):
    """Turns a sequence's growing output tokens into growing text (the engine supplies one)."""

    def add_token(self, token_id: int) -> str:
        """Append a token; return the newly completed text."""

    def flush(self) -> str:
        """At the end of the sequence: return whatever text is still held back."""

    def fork(self) -> "Detokenizer":
        """An independent copy, for a forked sequence."""


class TokenConstraint(Protocol):
    """What limits a sequence's next tokens (a grammar's state, allowed ids, banned words): an
    opaque object to this layer, which only forks it with the sequence (the engine supplies one)."""

    def accept_token(self, token_id: int) -> bool:
        """Advance past a generated token; False if the constraint did not allow it."""

    def fork(self) -> "TokenConstraint":
        """An independent copy, for a forked sequence."""


@dataclass(eq=False)
class Sequence:
    """One token stream. `num_computed_tokens` counts the leading tokens whose keys and values are
    in the KV cache; the rest are computed by the next scheduled steps."""

    seq_id: int
    prompt_token_ids: list[int]
    sample_index: int = 0  # which of the request's `best_of` samples this is (its seeded stream)
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # prompt + output, kept in step
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    cumulative_logprob: float = 0.0
    output_logprobs: list[PositionLogprobs] = field(default_factory=list)
    output_text: str = ""
    stop_reason: int | str | None = None
    detokenizer: Detokenizer | None = None  # set by the engine with the first output token
    # The state of the request's token constraints, for requests that have them; it moves on with
    # each appended token and survives preemption, since it lives here rather than in the cache.
    constraint: TokenConstraint | None = None
    # Speculative decoding: the tokens proposed to follow this sequence, set by the engine before
    # each step and cut by the scheduler to what it schedules (empty: an ordinary decode).
    draft_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int, logprob: float) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def fork(self, seq_id: int, sample_index: int | None = None) -> "Sequence":
        """A copy that shares nothing mutable with this sequence (block tables are forked by the
        block manager)."""
        return Sequence(
            seq_id=seq_id,
            prompt_token_ids=self.prompt_token_ids,
            sample_index=self.sample_index if sample_index is None else sample_index,
            output_token_ids=list(self.output_token_ids),
            token_ids=list(self.token_ids),
            num_computed_tokens=self.num_computed_tokens,
            status=self.status,
            cumulative_logprob=self.cumulative_logprob,
            output_logprobs=list(self.output_logprobs),
            output_text=self.output_text,
            detokenizer=self.detokenizer.fork() if self.detokenizer is not None else None,
            constraint=self.constraint.fork() if self.constraint is not None else None,
        )


@dataclass
class BeamState:
    """A beam search request's bookkeeping that outlives individual beams."""

    finished: list[tuple[float, Sequence]] = field(default_factory=list)  # (score, hypothesis), best first
    improvable: bool = True  # transformers' early-stop heuristic, sticky once False


@dataclass(eq=False)
class SequenceGroup:
    """One request and its sequences. Sequences that finish stay in `seqs` (their results are
    reported) but free their blocks at once."""

    request_id: str
    seqs: list[Sequence]
    sampling_params: SamplingParams
    arrival_time: float
    prompt: str | None = None
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache at first admission
    error: str | None = None
    # Set once the group's sequences have been forked from the first one (parallel sampling).
    forked: bool = False
    # Beam search bookkeeping (finished hypotheses and the stop heuristic); None for other requests.
    beam_state: BeamState | None = None
    # The API request this group is one prompt of (None: a request of its own), and its turn in
    # the waiting queue: the number of that API request's prompts waiting ahead of it when it
    # was queued (-1 once preempted: it goes before every new prompt).
    api_request_id: str | None = None
    turn: int = 0
    # A pooling (embedding) request: its prompt is computed and pooled, nothing is generated, and
    # it finishes (its blocks freed) in the step that completes the prompt. `pooled` holds the
    # engine's pool of the chunks computed so far and then the vector (opaque here).
    pooling_params: PoolingParams | None = None
    pooled: object | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    def seqs_with_status(self, status: SequenceStatus) -> list[Sequence]:
        return [s for s in self.seqs if s.status is status]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def num_unfinished_seqs(self) -> int:
        return sum(1 for s in self.seqs if not s.is_finished)

    def set_status(self, status: SequenceStatus) -> None:
        for seq in self.unfinished_seqs():
            seq.status = status
