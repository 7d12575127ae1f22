"""Per-request decoding parameters, named as in vLLM.

Plain data only: this module imports nothing from the package and nothing heavy, because a
`SamplingParams` travels inside the scheduler's control message to every worker.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from enum import Enum

from pagedllm.field_types import check_field_types


@dataclass
class StructuredOutputsParams:
    """A constraint on the output's text, as vLLM's `StructuredOutputsParams`: exactly one of a
    JSON schema (`json`, a dict or its JSON text), any JSON object (`json_object`), a regular
    expression, a choice among strings, or an EBNF grammar (GBNF, as xgrammar reads it).

    The engine compiles it once per distinct spec, off its step loop, and masks every step's
    logits to the tokens that keep the output inside the language."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON without whitespace between tokens (vLLM's option): shorter outputs, and no runs of
    # whitespace that a small model can fall into.
    disable_any_whitespace: bool = False
    # A reasoning model's thinking is not constrained (as in vLLM): the grammar starts, from its
    # initial state, at the token after the output holds these token ids (the reasoning parser's
    # end tag, `</think>`). None: the grammar applies from the first token.
    reasoning_end_token_ids: list[int] | None = None
    # With reasoning_end_token_ids: thinking has not begun yet, and the output may open it with
    # this token as its first one (the first step allows it besides the grammar's tokens); any
    # other first token starts the grammar at once. None: thinking is open from the first token.
    reasoning_start_token_id: int | None = None
    # The request field the constraint came from, named in errors (an HTTP request sets it).
    field_name: str = field(default="structured_outputs", compare=False, repr=False)

    def __post_init__(self) -> None:
        check_field_types(self, self.field_name)
        given = [name for name in _CONSTRAINT_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"{self.field_name} must set exactly one of {', '.join(_CONSTRAINT_KINDS)}; got "
                f"{', '.join(given) if given else 'none'}."
            )
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise ValueError(f"{self.field_name}.choice must be a non-empty list of non-empty strings.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{self.field_name}.{name} must be a non-empty string.")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"{self.field_name}.json must be a JSON schema (an object, or its JSON text).")
        end = self.reasoning_end_token_ids
        if end is not None and (not end or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in end)):
            raise ValueError(f"{self.field_name}.reasoning_end_token_ids must be a non-empty list of token ids >= 0.")
        start = self.reasoning_start_token_id
        if start is not None and (isinstance(start, bool) or start < 0 or end is None):
            raise ValueError(f"{self.field_name}.reasoning_start_token_id must be a token id >= 0, given with "
                             "reasoning_end_token_ids.")

    @property
    def kind(self) -> str:
        return next(name for name in _CONSTRAINT_KINDS if getattr(self, name) not in (None, False))

    @property
    def param(self) -> str:
        """The request field an error about this constraint names."""
        return f"{self.field_name}.{self.kind}" if self.field_name == "structured_outputs" else self.field_name


_CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# OpenAI's bound on logit_bias values; larger ones are clamped, as OpenAI and vLLM do.
LOGIT_BIAS_LIMIT = 100.0
# Seeds are refused outside [0, 2**64): a random stream's seed is 64 bits, and wrapping a larger
# one (2**64 acting as 0) would give two requests the same stream silently.
SEED_LIMIT = 1 << 64


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
    # Constraints on the tokens: a grammar (structured outputs), an additive bias per token id
    # (clamped to +-100), the only ids that may be drawn, and words that must not appear.
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Filled in by the engine: the model's EOS id, and the ids that end a sequence.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        check_field_types(self)
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
        if self.logit_bias:
            self.logit_bias = {t: max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(b))) for t, b in self.logit_bias.items()}

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
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < SEED_LIMIT):
            raise bad("seed", self.seed, "an integer in [0, 2**64)")  # a random stream's whole seed, never wrapped
        if self.use_beam_search:
            if self.best_of < 2:
                raise bad("best_of", self.best_of, "the beam width, >= 2, with use_beam_search")
            if self.temperature > _GREEDY_EPS:
                raise bad("temperature", self.temperature, "0 with use_beam_search")
            if self.top_p < 1.0 or self.top_k or self.min_p:
                raise ValueError("top_p, top_k and min_p cannot be used with use_beam_search.")
        elif self.temperature < _GREEDY_EPS and self.n > 1:
            raise bad("n", self.n, "1 with greedy sampling (temperature=0: every sample would be the same); give a "
                      "temperature above 0, or use_beam_search for several distinct sequences")
        elif self.temperature < _GREEDY_EPS and self.best_of > 1:
            raise bad("best_of", self.best_of, "1 with greedy sampling (temperature=0)")
        if self.early_stopping not in (True, False, "never"):
            raise bad("early_stopping", self.early_stopping, "True, False or 'never'")
        self._verify_token_controls(bad)

    def _verify_token_controls(self, bad) -> None:
        def is_token_id(t: object) -> bool:
            return isinstance(t, int) and not isinstance(t, bool) and t >= 0

        if self.logit_bias is not None and (
            not isinstance(self.logit_bias, dict)
            or any(not is_token_id(t) for t in self.logit_bias)
            or any(not isinstance(b, numbers.Real) or not math.isfinite(b) for b in self.logit_bias.values())
        ):
            raise bad("logit_bias", self.logit_bias, "a map of token ids >= 0 to finite numbers")
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list)
            or not self.allowed_token_ids
            or any(not is_token_id(t) for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list of token ids >= 0")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)
        ):
            raise bad("bad_words", self.bad_words, "a list of non-empty strings")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", self.structured_outputs, "a StructuredOutputsParams")

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

    @property
    def needs_token_mask(self) -> bool:
        """Whether each step's next tokens are restricted by a mask the engine computes."""
        return bool(self.structured_outputs is not None or self.allowed_token_ids or self.bad_words)


@dataclass
class BeamSearchParams:
    """Parameters of `LLM.beam_search`, as in vLLM."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        check_field_types(self)
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
