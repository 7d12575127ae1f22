"""What the engine hands back to users: `RequestOutput` and its `CompletionOutput`s, and for
pooling requests `PoolingRequestOutput` (vLLM's shapes).

Plain data; imports nothing from the package.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    """The log-probability of one token, its rank in the distribution (1 = most likely), and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's log-probabilities: the chosen token and the top-k, keyed by token id.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop", "length", "abort", or None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (seconds, `time.monotonic()`) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request after an engine step (or at its end)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine had to fail this request
    extra: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        texts = [o.text for o in self.outputs]
        return f"RequestOutput(request_id={self.request_id!r}, finished={self.finished}, outputs={texts!r})"


@dataclass
class PoolingOutput:
    """The vector of one pooling request (vLLM's `PoolingOutput`)."""

    data: Any  # a float32 torch tensor [dimensions or hidden_size], on the CPU

    @property
    def embedding(self) -> list[float]:
        """The vector as a list (vLLM's `EmbeddingOutput.embedding`)."""
        return self.data.tolist()

    @property
    def hidden_size(self) -> int:
        return len(self.data)


@dataclass
class PoolingRequestOutput:
    """The state of one pooling request after an engine step (vLLM's `PoolingRequestOutput`):
    `outputs` is None until the request finishes with its vector."""

    request_id: str
    outputs: PoolingOutput | None
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine had to fail this request

    def __repr__(self) -> str:
        size = None if self.outputs is None else self.outputs.hidden_size
        return f"PoolingRequestOutput(request_id={self.request_id!r}, finished={self.finished}, size={size})"


@dataclass
class EmbeddingOutput:
    """vLLM's `EmbeddingOutput`: the vector as a list of floats."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's `EmbeddingRequestOutput`)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(output.request_id, EmbeddingOutput(output.outputs.embedding), output.prompt_token_ids,
                   output.finished)
