"""Pythonic calls (Llama 3.2 and 4, and models trained like them): a Python list of calls with
keyword arguments of literal values, `[get_weather(city="Paris"), f(x=1)]`, as the whole answer
or inside `<|python_start|>...<|python_end|>` after some content. Each argument is converted to
JSON once its value is whole, so the arguments stream argument by argument."""

from __future__ import annotations

import ast
import json
import re

from pagedllm.entrypoints.openai.tool_parsers.base import CallDraft, MalformedCall, Scan, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.call_grammar import each_tool, grammar_text, leading_or_tagged, python_call, separated
from pagedllm.entrypoints.openai.tool_parsers.text_scan import skip_space, tag_or_leading

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_KEYWORD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*=")
_PARTIAL_KEYWORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\s*")


class PythonicToolParser(ToolParser):
    TAG, TAG_END = "<|python_start|>", "<|python_end|>"

    def call_grammar(self) -> str | None:
        """`[name(keyword=literal, ...), ...]` as the answer, or after the tag (then its end tag)."""

        def build():
            calls = separated(each_tool(self.tools, python_call), ", ", "[", "]")
            return leading_or_tagged("[", calls, self.TAG, tag_end=self.TAG_END)

        return grammar_text(build)

    def scan(self, text: str, final: bool) -> Scan:
        opened = tag_or_leading(text, self.TAG, "[")
        if isinstance(opened, int):
            return Scan(opened)  # no call yet
        start, pos = opened
        scan = Scan(start)
        try:
            closed = self._calls(text, pos, scan.calls)
            if final and not closed:
                scan.failed = True  # the list was never closed
        except MalformedCall:
            scan.failed = True
        return scan

    def _calls(self, text: str, pos: int, calls: list[CallDraft]) -> bool:
        """Read the list at `pos` into `calls`; whether its `]` was reached."""
        if pos >= len(text):
            calls.append(CallDraft())
            return False
        if text[pos] != "[":
            raise MalformedCall("pythonic calls are a list")
        pos += 1
        while True:
            draft = CallDraft()
            calls.append(draft)
            pos = self._call(text, skip_space(text, pos), draft)
            if pos is None:
                return False
            pos = skip_space(text, pos)
            if pos >= len(text):
                return False
            if text[pos] == "]":
                return True
            if text[pos] != ",":
                raise MalformedCall("calls are separated by commas")
            pos += 1

    def _call(self, text: str, pos: int, draft: CallDraft) -> int | None:
        """Read one call `name(k=v, ...)` into `draft`; the position after its `)`, or None."""
        name = _NAME.match(text, pos)
        name_end = name.end() if name is not None else pos
        if name_end >= len(text):
            return None  # the name may go on
        if name_end == pos or text[name_end] != "(":
            raise MalformedCall("a call is name(keyword=value, ...)")
        draft.name = self.known(text[pos:name_end])
        draft.arguments = "{"
        pos, num_args = name_end + 1, 0
        while True:
            pos = skip_space(text, pos)
            if pos >= len(text):
                return None
            if text[pos] == ")":
                draft.arguments += "}"
                draft.done = True
                return pos + 1
            keyword = _KEYWORD.match(text, pos)
            if keyword is None:
                if _PARTIAL_KEYWORD.fullmatch(text, pos):
                    return None
                raise MalformedCall("arguments are keyword=value")
            value_start = skip_space(text, keyword.end())
            value_end = _literal_end(text, value_start)
            if value_end is None:
                return None
            value = _literal(text[value_start:value_end])
            piece = f"{json.dumps(keyword.group(1))}: {json.dumps(value, ensure_ascii=False)}"
            draft.arguments += (", " if num_args else "") + piece
            num_args += 1
            pos = value_end
            if text[pos] == ",":
                pos += 1


def _literal_end(text: str, pos: int) -> int | None:
    """Where the Python literal at `pos` ends (at a `,` or `)` outside brackets and strings);
    None if the text ends first."""
    depth, quote, i = 0, None, pos
    while i < len(text):
        char = text[i]
        if quote is not None:
            if char == "\\":
                i += 1
            elif char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                return i if char == ")" else _bad("unbalanced brackets")
            depth -= 1
        elif char == "," and depth == 0:
            return i
        i += 1
    return None


def _literal(source: str) -> object:
    try:
        value = ast.literal_eval(source.strip())
        json.dumps(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise MalformedCall(f"{source!r} is not a literal") from None
    return value


def _bad(why: str):
    raise MalformedCall(why)
