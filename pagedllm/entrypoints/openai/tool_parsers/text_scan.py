"""Small scanners the formats share: where a JSON value ends in text that may still be growing,
a `{"name": ..., "arguments": {...}}` call object read as it grows, and fixed tags."""

from __future__ import annotations

import json
import re

from pagedllm.entrypoints.openai.tool_parsers.base import CallDraft, MalformedCall, ToolParser, held_back

WHITESPACE = " \t\n\r"
_SCALAR_END = set(WHITESPACE + ",]});")
# A call object's head in the usual key order: its name, then its arguments' key.
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def expect(text: str, pos: int, literal: str) -> int | None:
    """The position after `literal` at `pos`; None if the text ends inside it; MalformedCall if
    something else is there."""
    if text.startswith(literal, pos):
        return pos + len(literal)
    if literal.startswith(text[pos:]):
        return None
    raise MalformedCall(f"expected {literal!r} at {pos}")


def value_end(text: str, pos: int, final: bool) -> int | None:
    """The position after the JSON value that starts at `pos`; None if the text ends inside it.
    Brackets and strings are matched here; the value's validity is json.loads's to check."""
    if pos >= len(text):
        return None
    first = text[pos]
    if first in "{[\"":
        depth, in_string, i = 0, False, pos
        while i < len(text):
            char = text[i]
            if in_string:
                if char == "\\":
                    i += 1
                elif char == '"':
                    in_string = False
                    if depth == 0:
                        return i + 1
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    if first in "-0123456789tfn":
        i = pos
        while i < len(text) and text[i] not in _SCALAR_END:
            i += 1
        return i if i < len(text) or final else None
    raise MalformedCall(f"no JSON value at {pos}")


def call_object(parser: ToolParser, text: str, pos: int, final: bool, args_keys=("arguments", "parameters")) -> tuple[CallDraft, int | None]:
    """The call object at `pos` (`{"name": ..., "arguments": {...}}`, or "parameters") and the
    position after it (None while it is unfinished). In the usual key order its name is known
    and its arguments stream as soon as they begin; in another order the call is read whole."""
    end = value_end(text, pos, final)
    head = _HEAD.match(text, pos)
    draft = CallDraft()
    if head is not None:
        name = parser.known(json.loads(f'"{head.group(1)}"'))
        args_start = head.end()
        if text.startswith("{", args_start):  # announced once its arguments surely are an object
            draft.name = name
            args_end = value_end(text, args_start, final)
            draft.arguments = text[args_start:args_end] if args_end is not None else text[args_start:]
        elif args_start < len(text) and text[args_start] != '"':
            raise MalformedCall("arguments must be a JSON object")
    elif end is None and not text.startswith("{", pos):
        raise MalformedCall("a call is a JSON object")
    if end is None:
        return draft, None
    try:
        value = json.loads(text[pos:end])
    except ValueError:
        raise MalformedCall("the call is not JSON") from None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise MalformedCall("a call needs a name")
    arguments = next((value[k] for k in args_keys if k in value), {})
    if isinstance(arguments, str):  # arguments written as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise MalformedCall("arguments are no JSON") from None
        draft.arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, dict):
        raise MalformedCall("arguments must be a JSON object")
    draft.name = parser.known(value["name"])
    if not draft.arguments or head is None:
        draft.arguments = json.dumps(arguments, ensure_ascii=False)
    draft.done = True
    return draft, end


def call_array(parser: ToolParser, text: str, pos: int, final: bool, calls: list[CallDraft], args_keys=("arguments", "parameters")) -> int | None:
    """The calls of a JSON array whose `[` is just before `pos`, appended to `calls`; the
    position after its `]` (None while it is unfinished)."""
    pos = skip_space(text, pos)
    if text.startswith("]", pos):
        raise MalformedCall("an empty list of calls")
    while True:
        if pos >= len(text):
            calls.append(CallDraft())
            return None
        draft, end = call_object(parser, text, pos, final, args_keys)
        calls.append(draft)
        if end is None:
            return None
        pos = skip_space(text, end)
        if pos >= len(text):
            return None
        if text[pos] == "]":
            return pos + 1
        if text[pos] != ",":
            raise MalformedCall("calls are separated by commas")
        pos = skip_space(text, pos + 1)


def tag_or_leading(text: str, tag: str, opening: str) -> tuple[int, int] | int:
    """Where the calls of a format open: at `tag` anywhere, or at `opening` (`{`, `[`) when the
    answer begins with it. (start of the calls, where their text begins) if they open; else how
    much of the text is surely content (all but a tail that may still become the tag; nothing
    while only whitespace has come: a call may still open)."""
    at = text.find(tag)
    first = skip_space(text, 0)
    if at != -1:
        return at, skip_space(text, at + len(tag))
    if text.startswith(opening, first):
        return first, first
    if first >= len(text):
        return 0
    return held_back(text, 0, tag)
