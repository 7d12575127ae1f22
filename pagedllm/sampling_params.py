"""Per-request decoding parameters, named as in vLLM.

Plain data only: this module imports nothing from the package and nothing heavy, because a
`SamplingParams` travels inside the scheduler's control message to every worker.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from enum import Enum


class SamplingType(Enum):
    GREEDY = "greedy"
    RANDOM = "random"
    BEAM = "beam"


# Below this temperature sampling is treated as greedy (argmax), as vLLM does.
_GREEDY_EPS = 1e-5
# The fields that must be finite numbers.
_FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "length_penalty"
)


@dataclass
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    `temperature=0` means greedy decoding. `n` sequences are returned out of `best_of`
    generated (ranked by cumulative log-probability). `seed` makes a request's random draws
    independent of whatever else runs in the same batch.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filter
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Filled in by the engine: the model's EOS id, and the ids that end a sequence.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.best_of is None:
            self.best_of = self.n
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()
        if self.temperature < _GREEDY_EPS and not self.use_beam_search:
            # Greedy: the random-only knobs are irrelevant; normalise them so batching code can
            # test one flag.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def bad(name: str, value: object, rule: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} must be {rule}, got {value!r}.")

        for name in _FLOAT_FIELDS:  # NaN passes every range check below, infinities some
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise bad(name, value, "a finite number")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if not isinstance(self.best_of, int) or self.best_of < self.n:
            raise bad("best_of", self.best_of, f"an integer >= n ({self.n})")
        if self.temperature < 0.0:
            raise bad("temperature", self.temperature, ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "an integer >= 0 (0 or -1 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", self.repetition_penalty, "in (0, 2]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1 (or None: up to the context)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", self.logprobs, "an integer in [0, 20]")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20
        ):
            raise bad("prompt_logprobs", self.prompt_logprobs, "an integer in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "an integer")
        if self.use_beam_search:
            if self.best_of < 2:
                raise bad("best_of", self.best_of, "the beam width, >= 2, with use_beam_search")
            if self.temperature > _GREEDY_EPS:
                raise bad("temperature", self.temperature, "0 with use_beam_search")
            if self.top_p < 1.0 or self.top_k or self.min_p:
                raise ValueError("top_p, top_k and min_p cannot be used with use_beam_search.")
        elif self.temperature < _GREEDY_EPS and self.best_of > 1:
            raise bad("best_of", self.best_of, "1 with greedy sampling (temperature=0)")
        if self.early_stopping not in (True, False, "never"):
            raise bad("early_stopping", self.early_stopping, "True, False or 'never'")

    @property
    def sampling_type(self) -> SamplingType:
        if self.use_beam_search:
            return SamplingType.BEAM
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM

    @property
    def needs_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass
class BeamSearchParams:
    """Parameters of `LLM.beam_search`, as in vLLM."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"BeamSearchParams.beam_width must be an integer >= 1, got {self.beam_width!r}.")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if not isinstance(self.length_penalty, numbers.Real) or not math.isfinite(self.length_penalty):
            raise ValueError(f"BeamSearchParams.length_penalty must be a finite number, got {self.length_penalty!r}.")

    def to_sampling_params(self) -> SamplingParams:
        if self.beam_width == 1:
            return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos)
        return SamplingParams(
            n=self.beam_width,
            best_of=self.beam_width,
            use_beam_search=True,
            temperature=0.0,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
        )
