"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): its request
bodies, their translation into a chat-completion request (so a message takes the chat route's
own path: the chat template with tools, the Hermes parser, the tool_choice constraints), its
stop reasons and its error shape.

The translation, block by block:
- `system` (a string or text blocks) -> a system message;
- a user message's text blocks -> user messages, its `tool_result` blocks -> tool messages
  (`tool_call_id` = `tool_use_id`), in their order;
- an assistant message's text blocks -> its content, its `tool_use` blocks -> `tool_calls`
  (arguments: the input as JSON); earlier `thinking` blocks are dropped, as Anthropic does;
- a last message of the assistant's (a prefill, text only) -> left open by the template
  (`continue_final_message`): the reply continues it and holds only the new text;
- `tools` ({name, description, input_schema}) -> function tools; `tool_choice` auto -> "auto",
  any -> "required", tool -> the named function, none -> "none";
  `disable_parallel_tool_use` -> `parallel_tool_calls: false`;
- `stop_sequences` -> `stop`; `max_tokens`, `temperature`, `top_p`, `top_k` as they are
  (the newest `anthropic` clients send the last three only in `extra_body`);
- `output_config.format` (a JSON schema) -> `structured_outputs` (compact JSON under the schema).
- `thinking` `{"type": "enabled"}` / `{"type": "disabled"}` -> the template's `enable_thinking`
  (`chat_template_kwargs`); the thinking text is split off by the reasoning parser, if any.
Unknown fields are ignored, as Anthropic's API ignores them; `metadata` is accepted and unused.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIBaseModel

# --- errors -------------------------------------------------------------------------------------

# Anthropic's error types by HTTP status (its clients map the status to an exception class).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
# Chat-request fields as the Anthropic request names them, for the messages of errors raised
# on the chat path.
_FIELD_NAMES = {
    "stop": "stop_sequences", "max_completion_tokens": "max_tokens", "parallel_tool_calls": "tool_choice",
    "structured_outputs": "output_config.format",
}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error body of the Anthropic routes (for the OpenAPI document)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class AnthropicError(Exception):
    """An error answered in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    @classmethod
    def from_openai(cls, exc: OpenAIError) -> "AnthropicError":
        """An error of the chat path; its `param`, renamed as Anthropic names the field, leads the
        message (Anthropic's shape has no field for it)."""
        if exc.param is None:
            return cls(exc.status, exc.message)
        param = _FIELD_NAMES.get(exc.param, exc.param)
        return cls(exc.status, f"{param}: {exc.message}")


def invalid(message: str) -> AnthropicError:
    return AnthropicError(400, message)


# --- requests -----------------------------------------------------------------------------------


class TextBlock(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ContentBlock(OpenAIBaseModel):
    """One block of a message's content. Which fields a type needs is checked in `chat_messages`,
    where a missing one is named by its place (`messages[1].content[0].input`)."""

    type: str
    text: str | None = None  # text
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None  # tool_result: a string or text blocks
    is_error: bool | None = None  # tool_result


class AnthropicMessage(OpenAIBaseModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(OpenAIBaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required of custom tools; server tools have none
    type: str | None = None  # "custom", or a server tool's type (refused)


class AnthropicToolChoice(OpenAIBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # with "tool"
    disable_parallel_tool_use: bool | None = None


class AnthropicCountTokensRequest(OpenAIBaseModel):
    """`POST /v1/messages/count_tokens`: the prompt part of a message request."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    # {"type": "enabled" | "disabled", ...}: the template's enable_thinking (Qwen3's and others');
    # the thinking itself is found by --reasoning-parser.
    thinking: dict[str, Any] | None = None

    def to_chat_request(self, **sampling: Any) -> ChatCompletionRequest:
        """The chat-completion request this one stands for; `sampling`: its other fields (those
        set only, so the generation config still fills the rest)."""
        fields: dict[str, Any] = {"model": self.model, "messages": chat_messages(self.system, self.messages)}
        if self.messages[-1].role == "assistant":  # prefilled: the output continues that message
            fields.update(add_generation_prompt=False, continue_final_message=True)
        thinking_type = (self.thinking or {}).get("type")
        if thinking_type in ("enabled", "disabled"):
            fields["chat_template_kwargs"] = {"enable_thinking": thinking_type == "enabled"}
        if self.tools:
            fields["tools"] = chat_tools(self.tools)
        if self.tool_choice is not None:
            fields["tool_choice"], parallel = chat_tool_choice(self.tool_choice, bool(self.tools))
            if not parallel:
                fields["parallel_tool_calls"] = False
        try:
            return ChatCompletionRequest(**fields, **{k: v for k, v in sampling.items() if v is not None})
        except ValueError as exc:  # pydantic's, for a value the chat request takes narrower
            raise invalid(f"The request does not translate to a chat request: {exc}") from None


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    """`POST /v1/messages`."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # accepted (user_id); changes nothing
    stream: bool = False
    output_config: dict[str, Any] | None = None  # its `format` (a JSON schema) constrains the output; `effort` is ignored

    def to_chat_request(self) -> ChatCompletionRequest:  # type: ignore[override]
        return super().to_chat_request(
            max_tokens=self.max_tokens, stop=self.stop_sequences or None,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            structured_outputs=self._structured_outputs(),
        )

    def _structured_outputs(self) -> dict | None:
        """`output_config.format` (`{"type": "json_schema", "schema": {...}}`) as the chat request's
        structured output: the output is compact JSON valid under the schema."""
        output_format = (self.output_config or {}).get("format")
        if output_format is None:
            return None
        if not isinstance(output_format, dict) or output_format.get("type") != "json_schema":
            raise invalid("output_config.format: give {'type': 'json_schema', 'schema': {...}}.")
        schema = output_format.get("schema")
        if not isinstance(schema, dict):
            raise invalid("output_config.format.schema: give a JSON schema object.")
        return {"json": schema, "disable_any_whitespace": True}


# --- translation --------------------------------------------------------------------------------

_UNSUPPORTED_MEDIA = ("image", "document", "search_result")
_EARLIER_THINKING = ("thinking", "redacted_thinking")


def system_text(system: str | list[TextBlock] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n".join(block.text for block in system)


def chat_messages(system: str | list[TextBlock] | None, messages: list[AnthropicMessage]) -> list[dict]:
    """The conversation as chat messages (see the module's docstring); a 400 naming the block's
    place for a block this server cannot take."""
    result: list[dict] = []
    if system is not None:
        result.append({"role": "system", "content": system_text(system)})
    for i, message in enumerate(messages):
        if isinstance(message.content, str):
            result.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            result.extend(_user_turns(message.content, f"messages[{i}]"))
        else:
            result.append(_assistant_turn(message.content, f"messages[{i}]"))
    if messages[-1].role == "assistant":  # a prefill: the reply continues it
        last = result[-1]
        where = f"messages[{len(messages) - 1}]"
        if last.get("tool_calls"):
            raise invalid(f"{where}: a final (prefilled) assistant message is text the reply continues; it may not hold tool_use blocks.")
        if (last["content"] or "") != (last["content"] or "").rstrip():
            raise invalid(f"{where}: a final (prefilled) assistant message may not end with whitespace.")
    return result


def _user_turns(blocks: list[ContentBlock], where: str) -> list[dict]:
    turns: list[dict] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if block.type == "text":
            texts.append(_needs(block.text, at, "text"))
        elif block.type == "tool_result":
            if texts:
                turns.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            tool_use_id = _needs(block.tool_use_id, at, "tool_use_id")
            turns.append({"role": "tool", "tool_call_id": tool_use_id, "content": _tool_result_text(block.content, at)})
        else:
            _refuse_block(block.type, at, "user")
    if texts or not turns:
        turns.append({"role": "user", "content": "\n".join(texts)})
    return turns


def _assistant_turn(blocks: list[ContentBlock], where: str) -> dict:
    texts: list[str] = []
    calls: list[dict] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if block.type == "text":
            texts.append(_needs(block.text, at, "text"))
        elif block.type == "tool_use":
            name = _needs(block.name, at, "name")
            arguments = json.dumps(_needs(block.input, at, "input"), ensure_ascii=False)
            function = {"name": name, "arguments": arguments}
            calls.append({"id": _needs(block.id, at, "id"), "type": "function", "function": function})
        elif block.type not in _EARLIER_THINKING:
            _refuse_block(block.type, at, "assistant")
    turn: dict = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _tool_result_text(content: str | list[dict] | None, at: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for k, block in enumerate(content):
        kind = block.get("type")
        if kind != "text" or not isinstance(block.get("text"), str):
            _refuse_block(kind if isinstance(kind, str) else repr(kind), f"{at}.content[{k}]", "tool_result")
        texts.append(block["text"])
    return "\n".join(texts)


def _needs(value, at: str, name: str):
    if value is None:
        raise invalid(f"{at}.{name}: field required for this block type.")
    return value


def _refuse_block(kind: str, at: str, where: str) -> None:
    if kind in _UNSUPPORTED_MEDIA:
        raise invalid(
            f"{at}: {kind} blocks are not supported by this server (text-only models); send the content as text blocks."
        )
    allowed = {"user": "text, tool_result", "assistant": "text, tool_use, thinking", "tool_result": "text"}[where]
    raise invalid(f"{at}: a block of type {kind!r} cannot appear in {where} content here; the types allowed are {allowed}.")


def chat_tools(tools: list[AnthropicTool]) -> list[dict]:
    result = []
    for i, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise invalid(
                f"tools[{i}]: server tools (type {tool.type!r}) are not supported by this server; declare a custom "
                "tool with name, description and input_schema."
            )
        if tool.input_schema is None:
            raise invalid(f"tools[{i}].input_schema: field required (a JSON schema of the tool's input object).")
        # In OpenAI's order (name, description, parameters): a template writes the tools as JSON.
        function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema}
        if tool.description is None:
            del function["description"]
        result.append({"type": "function", "function": function})
    return result


def chat_tool_choice(choice: AnthropicToolChoice, has_tools: bool) -> tuple[str | dict, bool]:
    """(the chat request's tool_choice, whether parallel calls are allowed)."""
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if choice.name is None:
            raise invalid("tool_choice.name: field required when tool_choice.type is 'tool'.")
        if not has_tools:
            raise invalid("tool_choice: names a tool, but the request declares no tools.")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    if choice.type == "any" and not has_tools:
        raise invalid("tool_choice: 'any' needs tools; declare them in tools.")
    if not has_tools:  # "auto" or "none" without tools: nothing to choose
        return "none", parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


# --- responses ----------------------------------------------------------------------------------


def stop_reason(finish_reason: str | None, engine_stop: int | str | None) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, stop_sequence) for a chat finish reason ("tool_calls" when the
    model called tools) and the engine's stop reason (the stop string that ended the text)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(engine_stop, str):
        return "stop_sequence", engine_stop
    return "end_turn", None


def tool_use_id(call_id: str) -> str:
    """Anthropic's `toolu_...` for a chat call id (`call_...`)."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict | None:
    """A call's arguments as the object Anthropic's `input` must be; None if they are not one."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
