"""Request bodies of the OpenAI-compatible API (pydantic), with the extra sampling fields vLLM
accepts (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `use_beam_search`, ...).

Unknown fields are accepted and ignored, as vLLM does, so clients that send newer OpenAI fields
keep working. Known fields take exactly the JSON types the OpenAPI document gives them, as
OpenAI's API does: `"true"` or `1` is not a boolean, `false` is not a number, `"5"` not an
integer (pydantic's lax mode would convert them). Every number must be finite (JSON parsers
accept NaN and Infinity) and every text valid Unicode (a JSON escape such as \ud800 decodes to
a lone surrogate, which no tokenizer or UTF-8 response can carry): both are refused at
validation, as a 400 naming the field.
Responses are plain dicts in OpenAI's shapes, built by the serving modules.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pagedllm.entrypoints.openai.errors import bad_request, invalid_input
from pagedllm.entrypoints.openai.tools import resolve_tool_choice, tool_call_schema
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _field_is_valid_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        """Each field's strings, in lists and dicts too (nested models check their own)."""
        _check_text(value, info.field_name)
        return value

    @model_validator(mode="after")
    def _extra_fields_are_valid_unicode(self) -> "OpenAIBaseModel":
        for name, value in (self.__pydantic_extra__ or {}).items():
            _check_text(name, "an extra field's name")
            _check_text(value, f"the extra field {name[:40]!r}")
        return self


_INVALID_UNICODE = "{} holds invalid Unicode (a lone surrogate such as \\ud800); send valid UTF-8 text"
# The deepest a request field's JSON may nest (objects and lists): far above any real schema or
# message, and a body nested deeper is refused by name rather than walked.
MAX_NESTING = 100


def _check_text(value: Any, field: str) -> None:
    """A ValueError naming `field` if its strings (keys included, at any depth) hold a lone
    surrogate, or if it nests deeper than MAX_NESTING. Walked with a stack of its own: a body
    nested thousands deep cannot exhaust Python's (it once raised RecursionError, a 500)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(_INVALID_UNICODE.format(field)) from None
        elif isinstance(item, (list, tuple, dict)):
            if depth >= MAX_NESTING:
                raise ValueError(f"{field} nests more than {MAX_NESTING} levels of objects and lists; flatten it")
            children = [v for pair in item.items() for v in pair] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk


class SamplingRequest(OpenAIBaseModel):
    """The fields both generation endpoints share."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None  # default 1.0, or 0 with beam search
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    # Constraints: OpenAI's response_format, and vLLM's structured_outputs (json, regex, choice,
    # grammar, json_object, disable_any_whitespace), allowed_token_ids and bad_words.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None  # vLLM's: the top logprobs of every prompt token
    # vLLM's older constraint fields and llama.cpp's (GBNF `grammar`, `json_schema`): the same
    # structured outputs (LEGACY_CONSTRAINTS).
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    grammar: str | None = None
    json_schema: dict | bool | None = None
    guided_decoding_backend: str | None = None  # accepted: xgrammar is this server's one backend
    repeat_penalty: float | None = None  # llama-server's name of repetition_penalty

    @model_validator(mode="after")
    def _llama_server_habits(self) -> "SamplingRequest":
        """llama-server's clients send `max_tokens: -1` for "up to the context" (None here) and
        call the repetition penalty `repeat_penalty`."""
        if getattr(self, "max_tokens", None) == -1:
            self.max_tokens = None
        if self.repeat_penalty is not None and self.repetition_penalty is None:
            self.repetition_penalty = self.repeat_penalty
        return self

    def check_supported(self) -> None:
        if self.repeat_penalty not in (None, self.repetition_penalty):
            raise bad_request("repeat_penalty and repetition_penalty differ; give one.", "repeat_penalty")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true.", "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs are not available when stream is true.", "prompt_logprobs")

    def to_sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_param: str, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """The engine's parameters; a bad value is a 400 naming the field."""
        beam = self.use_beam_search
        temperature = self.temperature if self.temperature is not None else (0.0 if beam else 1.0)
        try:
            return SamplingParams(
                n=self.n,
                best_of=self.best_of,
                temperature=temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                min_p=self.min_p or 0.0,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                seed=self.seed,
                use_beam_search=beam,
                length_penalty=self.length_penalty,
                early_stopping=self.early_stopping,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                structured_outputs=self.structured_outputs_params(),
                logit_bias=self.token_logit_bias(),
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words,
            )
        except ValueError as exc:
            raise invalid_input(exc, prompt_param) from None

    def token_logit_bias(self) -> dict[int, float] | None:
        """OpenAI sends token ids as the map's keys, in text."""
        if not self.logit_bias:
            return None
        try:
            return {int(token_id): bias for token_id, bias in self.logit_bias.items()}
        except ValueError:
            raise bad_request("logit_bias keys must be token ids (integers, as text).", "logit_bias") from None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint from response_format or structured_outputs (one at most)."""
        specs = []
        kind = (self.response_format or {}).get("type", "text")
        if kind == "json_object":
            specs.append(StructuredOutputsParams(json_object=True, field_name="response_format"))
        elif kind == "json_schema":
            json_schema = self.response_format.get("json_schema")
            schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise bad_request("response_format.json_schema.schema must be a JSON schema object.", "response_format")
            specs.append(StructuredOutputsParams(json=schema_object(schema, "response_format"), field_name="response_format"))
        elif kind != "text":
            raise bad_request(
                f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}.", "response_format"
            )
        if self.structured_outputs is not None:
            try:
                specs.append(StructuredOutputsParams(**self.structured_outputs))
            except (TypeError, ValueError) as exc:
                raise bad_request(f"structured_outputs is invalid: {exc}", "structured_outputs") from None
        for name, kind in LEGACY_CONSTRAINTS.items():
            if (value := getattr(self, name)) is not None:
                if kind == "json" and isinstance(value, bool):
                    value = schema_object(value, name)
                try:
                    specs.append(StructuredOutputsParams(**{kind: value}, field_name=name))
                except ValueError as exc:
                    raise bad_request(str(exc).replace(f"{name}.{kind}", name), name) from None
        specs.extend(self.extra_constraints())
        if len(specs) > 1:
            given = [spec.field_name for spec in specs]
            raise bad_request(
                f"Give one output constraint, not {len(specs)} ({', '.join(given)}): response_format, "
                "structured_outputs, a guided_* field, grammar, json_schema, or a tool_choice that forces a call.",
                given[-1],
            )
        return specs[0] if specs else None

    def extra_constraints(self) -> list[StructuredOutputsParams]:
        """Constraints from other fields (the chat endpoint's tool_choice)."""
        return []

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def schema_object(schema: dict | bool, param: str) -> dict:
    """A JSON schema as an object: `true` (any value) is `{}`; `false` (no value) is refused."""
    if schema is False:
        raise bad_request(f"The JSON schema in {param} is false, which no value satisfies; give a schema that some "
                          "JSON value satisfies.", param)
    return {} if schema is True else schema


# Request fields of other servers' constraints -> the StructuredOutputsParams field they fill.
LEGACY_CONSTRAINTS = {
    "guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
    "grammar": "grammar", "json_schema": "json",
}

NonEmptyText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[int], Field(min_length=1)]


class CompletionRequest(SamplingRequest):
    """`POST /v1/completions`. `prompt` is a string, a list of token ids, or a list of either
    (a batch: each prompt gets `n` choices, numbered prompt by prompt)."""

    prompt: (
        NonEmptyText
        | TokenIds
        | Annotated[list[NonEmptyText], Field(min_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise bad_request("suffix is not supported by this server.", "suffix")

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens` 0: the prompt (and its logprobs) and nothing generated, as
        evaluation harnesses ask for a prompt's log-likelihood."""
        return self.echo and self.max_tokens == 0

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top logprobs per prompt token: `prompt_logprobs`, else `logprobs` when echoing them."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(SamplingRequest):
    """`POST /v1/chat/completions`: the messages go through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the context length
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # vLLM's: the output continues the last (assistant) message, left open by the template.
    continue_final_message: bool = False
    chat_template: str | None = None  # vLLM's: instead of the model's (or --chat-template)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the template
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # vLLM's: with a reasoning parser, false leaves the thinking out

    @property
    def tool_mode(self) -> str:
        """"none", "auto", "required", or the name of the function the model must call."""
        return resolve_tool_choice(self.tools, self.tool_choice)

    def extra_constraints(self) -> list[StructuredOutputsParams]:
        schema = tool_call_schema(self.tools, self.tool_mode, self.parallel_tool_calls) if self.tools else None
        # Calls are compact JSON: no runs of whitespace for a model to wander into.
        return [StructuredOutputsParams(json=schema, disable_any_whitespace=True, field_name="tools")] if schema is not None else []

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message continues the last message instead of opening a new one: set "
                              "add_generation_prompt to false with it.", "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise bad_request("continue_final_message continues an assistant message: the last message is the "
                              f"{self.messages[-1].role}'s.", "messages")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(OpenAIBaseModel):
    """`POST /tokenize` (vLLM's): a `prompt`, or chat `messages` through the template; or
    llama-server's `content` (its name of the prompt)."""

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]
