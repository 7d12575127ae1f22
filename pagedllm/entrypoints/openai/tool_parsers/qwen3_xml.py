"""Qwen3-Coder's XML calls (vLLM's `qwen3_xml`, also `qwen3_coder`):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text, typed by the tool's JSON schema (an integer, a number, a boolean,
null, an object or array as JSON); a parameter the schema does not type, or a value that is
not of its type, stays a string. Each parameter is converted once it is closed, so the
arguments stream parameter by parameter."""

from __future__ import annotations

import ast
import json
import re

from pagedllm.entrypoints.openai.tool_parsers.base import CallDraft, MalformedCall, Scan, ToolParser, held_back
from pagedllm.entrypoints.openai.tool_parsers.call_grammar import structural_tag_grammar
from pagedllm.entrypoints.openai.tool_parsers.text_scan import expect, skip_space

_INTEGER = re.compile(r"-?\d+")


class Qwen3XmlToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def call_grammar(self) -> str | None:
        """`<tool_call>\\n<function=NAME>\\n`, the parameters as xgrammar's qwen_xml style, then
        `</function>\\n</tool_call>`."""
        grammar = structural_tag_grammar(self.tools, self.START, lambda name: f"{self.START}\n<function={name}>\n",
                                         "</function>\n" + self.END, style="qwen_xml")
        # Two whitespace characters at most between the tags (the format's newline, or "\r\n"):
        # no runs of it for a model to wander into.
        return grammar.replace("[ \\n\\r\\t]*", "[ \\n\\r\\t]{0,2}") if grammar is not None else None

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(self.START)
        if start == -1:
            return Scan(held_back(text, 0, self.START))
        scan = Scan(start)
        try:
            pos = start
            while pos != -1:
                draft = CallDraft()
                scan.calls.append(draft)
                end = self._function(text, skip_space(text, pos + len(self.START)), draft)
                if end is None:
                    break
                after = skip_space(text, end)
                if after >= len(text) or expect(text, after, self.END) is None:
                    break
                pos = text.find(self.START, after)
        except MalformedCall:
            scan.failed = True
        return scan

    def _function(self, text: str, pos: int, draft: CallDraft) -> int | None:
        """Read `<function=NAME>...</function>` into `draft`; the position after it, or None."""
        name_start = expect(text, pos, "<function=")
        if name_start is None:
            return None
        close = text.find(">", name_start)
        if close == -1:
            if "<" in text[name_start:] or "\n" in text[name_start:]:
                raise MalformedCall("a function's name ends with '>'")
            return None
        draft.name = self.known(text[name_start:close].strip())
        properties = (self.tools or {}).get(draft.name, {}).get("parameters", {}).get("properties", {})
        draft.arguments = "{"
        pos, num_args = close + 1, 0
        while True:
            pos = skip_space(text, pos)
            if text.startswith("</function>", pos):
                draft.arguments += "}"
                draft.done = True
                return pos + len("</function>")
            if pos >= len(text) or "</function>".startswith(text[pos:]):
                return None
            key_start = expect(text, pos, "<parameter=")
            if key_start is None:
                return None
            close = text.find(">", key_start)
            value_end = text.find("</parameter>", close + 1) if close != -1 else -1
            if value_end == -1:
                return None
            key = text[key_start:close].strip()
            value = typed(_trim_newline(text[close + 1 : value_end]), properties.get(key))
            piece = f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
            draft.arguments += (", " if num_args else "") + piece
            num_args += 1
            pos = value_end + len("</parameter>")


def _trim_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def typed(value: str, schema: dict | None) -> object:
    """A parameter's text as the type its schema gives it (or as the one of its `enum` values it
    writes); a string when none fits."""
    for option in (schema or {}).get("enum", []):
        if value.strip() in (option, json.dumps(option, ensure_ascii=False)):
            return option
    kinds = (schema or {}).get("type", "string")
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        text = value.strip()
        if kind == "string":
            return value
        if kind == "null" and text.lower() in ("null", "none"):
            return None
        if kind == "integer" and _INTEGER.fullmatch(text):
            return int(text)
        if kind == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            return int(text) if _INTEGER.fullmatch(text) else number
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind in ("object", "array"):
            for load in (json.loads, ast.literal_eval):
                try:
                    parsed = load(text)
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    continue
                if isinstance(parsed, dict if kind == "object" else (list, tuple)):
                    try:
                        json.dumps(parsed)
                    except (TypeError, ValueError):
                        continue
                    return parsed
    return value
