"""The request body of llama-server's native `POST /completion` (llama.cpp's HTTP server), and
how its fields map onto the engine's `SamplingParams`.

Every field that changes the output is honoured or refused by name, never ignored:
- llama-server's own sampling fields map to the engine's (`n_predict` to `max_tokens`,
  `repeat_penalty` to `repetition_penalty`, `grammar` (GBNF) and `json_schema` to structured
  outputs, `n_probs` to logprobs, ...); when a request leaves one out, llama-server's default
  applies (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05), or the model's generation
  config where it sets one, as on /v1.
- Its samplers this engine does not have (`mirostat`, `typical_p`, `dry_*`, `xtc_*`, ...) are
  accepted only with the value that turns them off, which is what most clients send.
- Output-changing fields of other APIs (`response_format`, `logprobs` as a list, `echo`, ...)
  are refused with the field to send instead.
Other unknown fields (`id_slot`, `n_keep`, `cache_prompt`, ...: scheduling and caching, which
the engine decides on its own) are accepted and change nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request, invalid_input
from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

# llama-server's defaults for the fields a request leaves out.
LLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0}
# llama-server's "random seed" values.
RANDOM_SEEDS = (-1, 0xFFFFFFFF)
# The most top tokens the engine reports per position.
MAX_N_PROBS = 20
# The order the engine applies its samplers in, whatever a request's `samplers` says.
ENGINE_SAMPLERS = ["penalties", "temperature", "top_k", "top_p", "min_p"]


def _off(value: Any, test: Callable[[Any], bool]) -> bool:
    try:
        return bool(test(value))
    except TypeError:  # a value of another type is not the "off" value
        return False


# llama-server's fields this engine does not implement: each with the test its value must pass
# to change nothing (the value that turns it off), and that value.
_OFF_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "dynatemp_range": (lambda v: v == 0, "0"),
    "typical_p": (lambda v: v == 1, "1"),
    "mirostat": (lambda v: v == 0, "0"),
    "xtc_probability": (lambda v: v <= 0, "0"),
    "dry_multiplier": (lambda v: v == 0, "0"),
    "top_n_sigma": (lambda v: v <= 0, "-1"),
    "min_keep": (lambda v: v in (0, 1), "0"),
    "n_indent": (lambda v: v == 0, "0"),
    "t_max_predict_ms": (lambda v: v <= 0, "0"),
    "post_sampling_probs": (lambda v: v is False, "false"),
    "grammar_lazy": (lambda v: v is False, "false"),
    "n_cmpl": (lambda v: v == 1, "1"),
    "n": (lambda v: v == 1, "1"),
    "lora": (lambda v: v == [], "[]"),
    "response_fields": (lambda v: v == [], "[]"),
    "multimodal_data": (lambda v: not v, "[]"),
}


def sampler_left_on(extra: dict) -> tuple[str, str] | None:
    """(name, the value that turns it off) of the first field among `extra` that sets one of
    llama-server's samplers this engine does not have (and the like: `_OFF_VALUES`) to a value
    that would change the output; None if every one given is off."""
    for name, (is_off, off) in _OFF_VALUES.items():
        if name in extra and not _off(extra[name], is_off):
            return name, off
    return None


# Fields of other APIs that would change the output here if honoured: what to send instead.
_OTHER_APIS = {
    "max_completion_tokens": "n_predict",
    "repetition_penalty": "repeat_penalty",
    "response_format": "json_schema",
    "structured_outputs": "grammar or json_schema",
    "guided_json": "json_schema",
    "guided_grammar": "grammar",
    "guided_regex": "grammar",
    "guided_choice": "grammar",
    "top_logprobs": "n_probs",
    "echo": "POST /v1/completions",
    "suffix": "POST /v1/completions",
    "best_of": "POST /v1/completions",
    "use_beam_search": "POST /v1/completions",
    "min_tokens": "POST /v1/completions",
    "stop_token_ids": "POST /v1/completions",
    "allowed_token_ids": "POST /v1/completions",
    "bad_words": "POST /v1/completions",
    "include_stop_str_in_output": "POST /v1/completions",
    "messages": "POST /v1/chat/completions",
}
# llama-server's sampler names (and one-letter codes) -> the engine's, None for those it lacks
# (accepted when their fields turn them off, checked above).
_SAMPLER_NAMES = {
    "top_k": "top_k", "top-k": "top_k", "k": "top_k",
    "top_p": "top_p", "top-p": "top_p", "nucleus": "top_p", "p": "top_p",
    "min_p": "min_p", "min-p": "min_p", "m": "min_p",
    "temperature": "temperature", "temp": "temperature", "t": "temperature",
    "penalties": "penalties", "e": "penalties",
    "dry": None, "d": None, "typ_p": None, "typical_p": None, "typical": None, "y": None,
    "xtc": None, "x": None, "top_n_sigma": None, "top-n-sigma": None, "s": None, "tfs_z": None, "f": None,
}
# Engine field names -> this API's, for error messages.
_NAMES = {"repetition_penalty": "repeat_penalty", "max_tokens": "n_predict", "logprobs": "n_probs"}


def renamed(error: OpenAIError) -> OpenAIError:
    """An error about an engine field, naming the field of this API instead."""
    name = _NAMES.get(error.param or "")
    if name is not None:
        error.message = error.message.replace(f"SamplingParams.{error.param}", name).replace(error.param, name)
        error.param = name
    return error


class LlamaCompletionRequest(OpenAIBaseModel):
    """`POST /completion`. `prompt` is a string, a list of token ids and strings (one prompt:
    the strings are tokenized in place), or a list of such prompts (the answer is then a list)."""

    prompt: str | list[int | str | list[int | str]]
    n_predict: int | None = None  # -1: until the end of the sequence or of the context
    max_tokens: int | None = None  # llama-server's alias of n_predict
    temperature: float | None = None  # <= 0: greedy
    top_k: int | None = None  # <= 0: off
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None  # -1: random
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    grammar: str | None = None  # GBNF
    json_schema: dict | None = None
    n_probs: int | None = None
    logprobs: int | None = None  # llama-server's alias of n_probs, when n_probs is not given
    logit_bias: list[list[int | str | float | bool]] | dict[str, float | bool] | None = None
    samplers: list[str] | str | None = None
    stream: bool = False
    cache_prompt: bool = True  # the engine's prefix caching is its own setting
    return_tokens: bool = False
    timings_per_token: bool = False
    model: str | None = None  # ignored, as llama-server ignores it with one model

    def check_supported(self) -> None:
        """A 400 naming the first field this server cannot honour."""
        extra = self.model_extra or {}
        if (left_on := sampler_left_on(extra)) is not None:
            name, off = left_on
            raise bad_request(f"{name} is not supported by this server; send {name}: {off} (off) or leave it out.", name)
        for name, instead in _OTHER_APIS.items():
            if name in extra:
                raise bad_request(f"{name} is not a field of POST /completion; use {instead}.", name)
        if self.grammar and self.json_schema is not None:
            raise bad_request("Give one of grammar and json_schema.", "grammar")
        if self.n_predict_value < -1:
            raise bad_request(f"n_predict must be -1 (no limit) or >= 0, got {self.n_predict_value}.", "n_predict")
        if not 0 <= self.num_probs <= MAX_N_PROBS:
            raise bad_request(f"n_probs must be in [0, {MAX_N_PROBS}] on this server, got {self.num_probs}.", "n_probs")
        if self.repeat_last_n not in (None, -1, 0) and self._penalized:
            raise bad_request(
                "repeat_last_n: this server's penalties cover the whole sequence (repeat_penalty the prompt and "
                "output, presence and frequency the output); send -1, or 0 for no penalties.",
                "repeat_last_n",
            )

    @property
    def n_predict_value(self) -> int:
        n = self.n_predict if self.n_predict is not None else self.max_tokens
        return -1 if n is None else n

    @property
    def num_probs(self) -> int:
        return self.n_probs if self.n_probs is not None else (self.logprobs or 0)

    @property
    def _penalized(self) -> bool:
        return (self.repeat_penalty not in (None, 1.0) or bool(self.presence_penalty) or bool(self.frequency_penalty))

    def sampler_set(self) -> set[str]:
        """The engine's samplers the request's `samplers` keeps (all, when not given)."""
        if self.samplers is None:
            return set(ENGINE_SAMPLERS)
        names = list(self.samplers) if isinstance(self.samplers, str) else self.samplers
        unknown = [n for n in names if n.lower() not in _SAMPLER_NAMES]
        if unknown:
            raise bad_request(f"samplers: unknown sampler {unknown[0]!r}; known: {sorted(n for n in _SAMPLER_NAMES if len(n) > 1)}.", "samplers")
        return {_SAMPLER_NAMES[n.lower()] for n in names} - {None} | {"penalties"}

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.grammar:
            return StructuredOutputsParams(grammar=self.grammar, field_name="grammar")
        if self.json_schema is not None:  # compact JSON: no runs of whitespace for a model to wander into
            return StructuredOutputsParams(json=self.json_schema, disable_any_whitespace=True, field_name="json_schema")
        return None

    def to_sampling_params(self, defaults: dict, logit_bias: dict[int, float] | None) -> SamplingParams:
        """The engine's parameters (`defaults` for the fields left out, by this API's names);
        `n_predict` 0 runs one token, which the caller drops. A bad value is a 400 naming it."""
        def pick(name: str) -> Any:
            value = getattr(self, name)
            return defaults[name] if value is None else value

        kept = self.sampler_set()
        temperature = max(pick("temperature"), 0.0) if "temperature" in kept else 1.0
        penalties = self.repeat_last_n != 0
        n_predict = self.n_predict_value
        try:
            return SamplingParams(
                temperature=temperature,
                top_k=max(pick("top_k"), 0) if "top_k" in kept else 0,
                top_p=pick("top_p") if "top_p" in kept else 1.0,
                min_p=pick("min_p") if "min_p" in kept else 0.0,
                repetition_penalty=pick("repeat_penalty") if penalties else 1.0,
                presence_penalty=(self.presence_penalty or 0.0) if penalties else 0.0,
                frequency_penalty=(self.frequency_penalty or 0.0) if penalties else 0.0,
                seed=None if self.seed in RANDOM_SEEDS else self.seed,
                stop=[s for s in ([self.stop] if isinstance(self.stop, str) else self.stop or []) if s],
                ignore_eos=self.ignore_eos,
                max_tokens=None if n_predict == -1 else max(n_predict, 1),
                logprobs=self.num_probs or None,
                structured_outputs=self.structured_outputs(),
                logit_bias=logit_bias,
            )
        except ValueError as exc:
            raise renamed(invalid_input(exc, "prompt")) from None


def llama_defaults(default_sampling: dict) -> dict:
    """llama-server's defaults, with the model's generation config (`--generation-config`)
    where it sets a value, by this API's names."""
    named = {"repeat_penalty" if k == "repetition_penalty" else k: v for k, v in default_sampling.items()}
    return {name: named.get(name, value) for name, value in LLAMA_DEFAULTS.items()}


def generation_settings(params: SamplingParams, stream: bool = False, n_probs: int = 0) -> dict:
    """llama-server's `generation_settings` (its slot `params`): the values the engine uses, the
    samplers it does not have shown off."""
    spec = params.structured_outputs
    n_predict = -1 if params.max_tokens is None else params.max_tokens
    return {
        "n_predict": n_predict,
        "max_tokens": n_predict,
        "seed": RANDOM_SEEDS[1] if params.seed is None else params.seed,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "repeat_last_n": -1,
        "repeat_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "stop": list(params.stop or []),
        "ignore_eos": params.ignore_eos,
        "stream": stream,
        "n_probs": n_probs,
        "grammar": spec.grammar if spec is not None and spec.grammar else "",
        "json_schema": spec.json if spec is not None and spec.json is not None else None,
        "logit_bias": [[t, b] for t, b in (params.logit_bias or {}).items()],
        "samplers": ENGINE_SAMPLERS,
        "dynatemp_range": 0.0, "typical_p": 1.0, "mirostat": 0, "xtc_probability": 0.0, "dry_multiplier": 0.0,
        "top_n_sigma": -1.0, "min_keep": 0, "n_keep": 0, "n_discard": 0, "post_sampling_probs": False,
    }
