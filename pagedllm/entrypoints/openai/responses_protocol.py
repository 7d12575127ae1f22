"""OpenAI's Responses API (`POST /v1/responses`): its request body, the translation of its
input items into chat messages (so a response takes the chat route's own path: the chat
template with tools, the Hermes parser, the tool_choice constraints), and the output items a
finished generation becomes.

The translation, item by item:
- `instructions` -> a system message first (never carried over from a previous response, as
  OpenAI does);
- a string `input` -> one user message;
- `message` items (roles user, system, developer -> system, assistant; content a string or
  `input_text` / `output_text` parts) -> messages of that role;
- `function_call` items -> an assistant message's `tool_calls` (consecutive calls, and the
  assistant text just before them, make one message); `function_call_output` items -> tool
  messages (`tool_call_id` = `call_id`); `reasoning` items are dropped, as the chat route drops
  earlier thinking;
- `tools` (`{"type": "function", "name", "description", "parameters", "strict"}`) -> chat
  function tools; `tool_choice` {"type": "function", "name"} -> the named function;
- `text.format` json_schema / json_object -> `response_format`; `max_output_tokens` ->
  `max_tokens`; `temperature`, `top_p`, `parallel_tool_calls`, `user` as they are.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import Field

from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIBaseModel

_MESSAGE_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(OpenAIBaseModel):
    """`POST /v1/responses`. Unknown fields are logged and ignored, as on the other routes."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # {"effort", "summary"}: accepted; the parser finds the thinking
    # Accepted and unused: what to add to the output (encrypted reasoning, logprobs), the context
    # strategy (prompts are never truncated here), and OpenAI's routing and caching hints.
    include: list[str] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    background: bool = False

    def check_supported(self) -> None:
        if self.background:
            raise bad_request("background responses are not supported by this server; send background false.", "background")
        if self.truncation not in (None, "disabled"):
            raise bad_request("Prompts are never truncated here; send truncation 'disabled' or drop it.", "truncation")

    def input_items(self) -> list[dict]:
        """This request's own input as items (a string input is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return self.input

    def to_chat_request(self, items: list[dict]) -> ChatCompletionRequest:
        """The chat-completion request for the conversation `items` (earlier turns' items, then
        this request's) under this request's instructions, tools and sampling."""
        messages = chat_messages(items)
        if self.instructions is not None:
            messages.insert(0, {"role": "system", "content": self.instructions})
        if not messages:
            raise bad_request("input holds no message; send a string or at least one message item.", "input")
        fields: dict[str, Any] = {"model": self.model, "messages": messages, "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools:
            fields["tools"] = chat_tools(self.tools)
        if self.tool_choice is not None:
            fields["tool_choice"] = chat_tool_choice(self.tool_choice)
        response_format = chat_response_format(self.text)
        sampling = {"response_format": response_format, "max_tokens": self.max_output_tokens,
                    "temperature": self.temperature, "top_p": self.top_p, "user": self.user}
        fields.update({k: v for k, v in sampling.items() if v is not None})  # unset: the generation config's
        try:
            return ChatCompletionRequest(**fields)
        except ValueError as exc:  # pydantic's, for a value the chat request takes narrower
            raise bad_request(f"The request does not translate to a chat request: {exc}", "input") from None

    def echo_fields(self) -> dict:
        """The request's settings as a response object repeats them."""
        return {
            "instructions": self.instructions,
            "tools": [_function_tool(tool) for tool in self.tools or []],
            "tool_choice": self.tool_choice if self.tool_choice is not None else "auto",
            "parallel_tool_calls": self.parallel_tool_calls,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_output_tokens": self.max_output_tokens,
            "previous_response_id": self.previous_response_id,
            "text": {"format": (self.text or {}).get("format") or {"type": "text"}},
            "metadata": self.metadata or {},
            "user": self.user,
            "store": self.store,
            "reasoning": {"effort": (self.reasoning or {}).get("effort"), "summary": None},
            "truncation": "disabled",
            "background": False,
        }


# --- input items -> chat messages ---------------------------------------------------------------


def chat_messages(items: list[dict]) -> list[dict]:
    """The conversation of `items` as chat messages (see the module's docstring); a 400 naming
    the item's place for one this server cannot take."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{at} must be an object (an input item).", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            role = _MESSAGE_ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise bad_request(f"{at}.role must be one of {sorted(_MESSAGE_ROLES)}, got {item.get('role')!r}.", "input")
            messages.append({"role": role, "content": _content_text(item.get("content"), at)})
        elif kind == "function_call":
            call = {"id": _needs(item, "call_id", at), "type": "function",
                    "function": {"name": _needs(item, "name", at), "arguments": _needs(item, "arguments", at)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the text and the calls of one turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _content_text(output, f"{at}.output")
            messages.append({"role": "tool", "tool_call_id": _needs(item, "call_id", at), "content": text})
        elif kind != "reasoning":
            raise bad_request(
                f"{at}: input items of type {kind!r} are not supported by this server; the types allowed are "
                "message, function_call, function_call_output and reasoning.",
                "input",
            )
    return messages


def _content_text(content: Any, at: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{at}.content must be a string or a list of input_text parts.", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{at}.content[{j}]: parts of type {kind!r} are not supported by this server (text-only models); "
                "send input_text parts with their text.",
                "input",
            )
        texts.append(part["text"])
    return "\n".join(texts)  # as the chat route joins a message's text parts


def _needs(item: dict, name: str, at: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{at}.{name}: a string is required for an item of type {item.get('type')!r}.", "input")
    return value


# --- tools and formats --------------------------------------------------------------------------


def _function_tool(tool: dict) -> dict:
    return {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict", True)}


def chat_tools(tools: list[dict]) -> list[dict]:
    result = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(
                f"tools[{i}]: tools of type {tool.get('type')!r} are not supported by this server; declare "
                "{'type': 'function', 'name', 'description', 'parameters'} tools.",
                "tools",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{i}].name must be a non-empty string.", "tools")
        # In the chat route's order (name, description, parameters): a template writes the tools as JSON.
        function = {"name": tool["name"], "description": tool.get("description"),
                    "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if function["description"] is None:
            del function["description"]
        result.append({"type": "function", "function": function})
    return result


def chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad_request(f"tool_choice must be 'auto', 'none', 'required' or a function, got {choice!r}.", "tool_choice")
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise bad_request(
            f"tool_choice of type {choice.get('type')!r} is not supported by this server; give 'auto', 'none', "
            "'required' or {'type': 'function', 'name': ...}.",
            "tool_choice",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_response_format(text: dict | None) -> dict | None:
    """`text.format` as the chat request's `response_format`."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad_request("text.format must be an object such as {'type': 'json_schema', 'schema': {...}}.", "text.format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be a JSON schema object.", "text.format")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}
    raise bad_request(
        f"text.format.type must be 'text', 'json_object' or 'json_schema', got {fmt.get('type')!r}.", "text.format"
    )


# --- output items -------------------------------------------------------------------------------


def reasoning_item(text: str, item_id: str | None = None) -> dict:
    return {"type": "reasoning", "id": item_id or new_item_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or new_item_id("msg"), "role": "assistant", "status": status,
            "content": [output_text_part(text)]}


def output_text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id or new_item_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(message: dict, reasoning: str | None, incomplete: bool) -> list[dict]:
    """A finished chat message (`tools.tool_message`'s) and its reasoning as output items:
    the reasoning, the text (if any, or if there are no calls), the function calls."""
    items = [reasoning_item(reasoning)] if reasoning else []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(message.get("content") or "", "incomplete" if incomplete else "completed"))
    for call in calls:
        items.append(function_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


def response_usage(num_input: int, num_cached: int, num_output: int, num_reasoning: int) -> dict:
    return {
        "input_tokens": num_input,
        "input_tokens_details": {"cached_tokens": num_cached, "cache_write_tokens": 0},
        "output_tokens": num_output,
        "output_tokens_details": {"reasoning_tokens": num_reasoning},
        "total_tokens": num_input + num_output,
    }


def stored_size(value: Any) -> int:
    """The bytes a stored value counts against the store's bound: its JSON's."""
    return len(json.dumps(value, ensure_ascii=False).encode())
