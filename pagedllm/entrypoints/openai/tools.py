"""Tool calling in chat completions: the tools' checks, the constraint that makes a model call
them (`tool_choice` "required" or a named function), the parser that finds the calls a model
makes on its own ("auto"), and the conversation the chat template sees.

"required" constrains the output to a JSON array of `{"name", "parameters"}` objects, one of the
tools each; a named function constrains it to that function's parameters. Either way any model
returns well-formed calls. With "auto", the model's own format is parsed by the server's
`--tool-call-parser` (the `tool_parsers` package, one module per family; Hermes by default),
and streamed as content deltas, then each call's id and name and its arguments as they grow.
"""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.tool_parsers import (  # noqa: F401 (re-exported: the parsers' old home)
    TOOL_PARSERS,
    HermesToolParser,
    ToolCall,
    ToolCallStream,
    ToolParser,
)


def tool_functions(tools: list[dict]) -> dict[str, dict]:
    """name -> the function's definition; a 400 naming `tools` for a malformed one."""
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}.", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string.", "tools")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object.", "tools")
        functions[name] = {**function, "parameters": parameters}
    return functions


def resolve_tool_choice(tools: list[dict] | None, tool_choice: str | dict | None) -> str:
    """"none", "auto", "required", or the name of the function to call; a 400 if it is not one."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools.", "tool_choice")
        return "none"
    functions = tool_functions(tools)
    if tool_choice is None:
        return "auto"
    if tool_choice in ("none", "auto", "required"):
        return tool_choice
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str):
        raise bad_request(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}.", "tool_choice"
        )
    if name not in functions:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools.", "tool_choice")
    return name


def tool_call_schema(tools: list[dict], choice: str, parallel: bool = True) -> dict | None:
    """The JSON schema that enforces `choice` ("required" or a function name); None otherwise."""
    functions = tool_functions(tools)
    if choice in functions:
        return functions[choice]["parameters"]
    if choice != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": f["parameters"]},
            "required": ["name", "parameters"],
        }
        for name, f in functions.items()
    ]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def constrained_calls(text: str, choice: str) -> list[ToolCall] | None:
    """The calls in an output constrained by `tool_call_schema` (None if it was cut short)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if choice != "required":
        return [ToolCall(choice, text.strip())]  # the arguments as generated (and as streamed)
    return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]


# --- the conversation the chat template sees ------------------------------------------------

_TOOLS_PROMPT = (
    "You may call one or more functions to assist with the user query. The functions are described in JSON "
    "within <tools></tools>:\n<tools>\n{tools}\n</tools>\nFor each function call, return a JSON object with the "
    'function name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n{{"name": <function-name>, '
    '"arguments": <args-json-object>}}\n</tool_call>'
)


def tool_fields(message) -> dict:
    """A chat message's tool fields (`tool_calls`, `tool_call_id`), those it has."""
    fields = {"tool_calls": message.tool_calls, "tool_call_id": message.tool_call_id}
    return {k: v for k, v in fields.items() if v is not None}


def template_conversation(conversation: list[dict], tools: list[dict] | None, template: str) -> list[dict]:
    """The messages as the template should see them. A template that knows tools gets them as
    they are (with `tools=` beside); for one that does not, the tools are described in the system
    message, assistant calls are written as Hermes `<tool_call>` blocks and tool results as
    `<tool_response>` blocks, so the model still sees the whole exchange."""
    knows_tools = "tool_calls" in template
    result = []
    for message in conversation:
        message = dict(message)
        if not knows_tools and message.get("tool_calls"):
            blocks = [
                f"<tool_call>\n{json.dumps({'name': c.get('function', {}).get('name', ''), 'arguments': _arguments(c)}, ensure_ascii=False)}\n</tool_call>"
                for c in message.pop("tool_calls")
            ]
            message["content"] = "\n".join(filter(None, [message.get("content") or "", *blocks]))
        if not knows_tools and message["role"] == "tool":
            message = {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
        message["content"] = message.get("content") or ""
        result.append(message)
    if tools and "tools" not in template:
        described = _TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if result and result[0]["role"] == "system":
            result[0] = {**result[0], "content": result[0]["content"] + "\n\n" + described}
        else:
            result.insert(0, {"role": "system", "content": described})
    return result


def _arguments(call: dict) -> object:
    arguments = call.get("function", {}).get("arguments", "{}")
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments


# --- responses --------------------------------------------------------------------------------


def _finish(calls: list[ToolCall], finish_reason: str | None) -> str | None:
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def tool_message(
    text: str, finish_reason: str | None, mode: str, parser: ToolParser | None = None
) -> tuple[dict, str | None]:
    """The assistant message of a finished choice, with its tool calls, and its finish reason.
    `parser`: the format of "auto" calls (Hermes, accepting any name, by default)."""
    if mode == "none":
        return {"role": "assistant", "content": text}, finish_reason
    if mode == "auto":
        content, calls = (parser or HermesToolParser()).extract(text)
    else:
        calls = constrained_calls(text, mode) or []
        content = None if calls else text
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.to_json() for call in calls]
    return message, _finish(calls, finish_reason)


class ToolCallStreamer:
    """A streamed choice's deltas in OpenAI's shape when tools are in play: content as it is
    sure to be content and `tool_calls` deltas: a named function's arguments as they grow; in
    "auto", each call's id and name once its name is whole, then its arguments as they grow
    (`ToolCallStream`); the calls of "required" once the output is complete."""

    def __init__(self, mode: str, parser: ToolParser | None = None) -> None:
        self.mode = mode
        self.parser = parser or HermesToolParser()
        self._text: dict[int, str] = {}
        self._sent: dict[int, int] = {}  # characters of each choice already sent
        self._call_ids: dict[int, str] = {}
        self._auto: dict[int, ToolCallStream] = {}  # each choice's, in "auto"

    def feed(self, position: int, new_text: str, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """(the deltas to send for this piece of one choice's text, its finish reason)."""
        if self.mode == "auto":
            stream = self._auto.setdefault(position, ToolCallStream(self.parser))
            deltas = stream.feed(new_text, final=finish_reason is not None)
            finish = "tool_calls" if stream.called and finish_reason == "stop" else finish_reason
            return deltas, finish
        text = self._text[position] = self._text.get(position, "") + new_text
        sent = self._sent.get(position, 0)
        if self.mode != "required":  # a named function: the text is its arguments
            deltas = []
            if position not in self._call_ids:
                call = ToolCall(self.mode, "")
                self._call_ids[position] = call.id
                deltas.append({"tool_calls": [call.to_json(index=0)]})
            if text[sent:]:
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text[sent:]}}]})
            self._sent[position] = len(text)
            return deltas, ("tool_calls" if finish_reason == "stop" else finish_reason)
        if finish_reason is None:
            return [], None
        message, finish = tool_message(text, finish_reason, self.mode)
        calls = message.get("tool_calls", [])
        if not calls:
            return ([{"content": text[sent:]}] if text[sent:] else []), finish
        return [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(calls)], finish
