"""Mistral's calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v0.3 and older), or
`[TOOL_CALLS]name[ARGS]{...}` once per call (v11 tokenizers and later; `[CALL_ID]id` may come
between). `[TOOL_CALLS]`, `[ARGS]` and `[CALL_ID]` are special tokens, skipped from the text by
default: so an answer that opens with the list of calls, or with a declared tool's name
followed by its arguments' `{`, is read as calls too.
"""

from __future__ import annotations

import json
import re

from pagedllm.entrypoints.openai.tool_parsers.base import CallDraft, MalformedCall, Scan, ToolParser, held_back
from pagedllm.entrypoints.openai.tool_parsers.call_grammar import each_tool, grammar_text, json_call, leading_or_tagged, separated
from pagedllm.entrypoints.openai.tool_parsers.text_scan import call_array, expect, skip_space, value_end

_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
_CALL_ID = re.compile(r"\[CALL_ID\][A-Za-z0-9]*")


class MistralToolParser(ToolParser):
    START, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def call_grammar(self) -> str | None:
        """After `[TOOL_CALLS]`, either form (the model's template decides which it writes): a
        list of `{"name": ..., "arguments": {...}}`, or `name[ARGS]{...}` calls, `[TOOL_CALLS]`
        between them; an answer that opens with `[` is the list. (One that opens with a declared
        tool's name and `{`, the named form with its special tokens skipped, is not constrained.)"""

        def build():
            from xgrammar.structural_tag import OrFormat

            listed = separated(each_tool(self.tools, json_call(lambda name: f'{{"name": {json.dumps(name)}, "arguments": ')),
                               ", ", "[", "]")
            named = separated(each_tool(self.tools, json_call(lambda name: name + self.ARGS, tail="")), self.START)
            return leading_or_tagged("[", listed, self.START, OrFormat(elements=[listed, named]))

        return grammar_text(build)

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(self.START)
        if start == -1:
            start = self._bare_start(text, final)
            if start is None:
                return Scan(held_back(text, 0, self.START))
            if start == len(text):
                return Scan(skip_space(text, 0))  # an opening may be under way
        scan = Scan(start)
        try:
            pos = skip_space(text, start + len(self.START) if text.startswith(self.START, start) else start)
            if pos >= len(text):
                scan.calls.append(CallDraft())
            elif text[pos] == "[" and not text.startswith("[ARGS]", pos):
                call_array(self, text, pos + 1, final, scan.calls, ("arguments", "parameters"))
            else:
                self._named_calls(text, pos, final, scan.calls)
        except MalformedCall:
            scan.failed = True
        return scan

    def _bare_start(self, text: str, final: bool) -> int | None:
        """Where calls whose special tokens were skipped open the answer: a `[`, or a declared
        tool's name and `{`. len(text): not known yet; None: the answer is no call."""
        first = skip_space(text, 0)
        if first >= len(text):
            return None if final else len(text)
        if self.START.startswith(text[first:]):
            return None if final else len(text)  # [TOOL_CALLS] itself may be coming
        if text[first] == "[":
            return first
        name_end = _NAME.match(text, first).end()
        if name_end >= len(text):
            return None if final or self.tools is None else len(text)
        if self.tools is not None and text[first:name_end] in self.tools and text[name_end] == "{":
            return first
        return None

    def _named_calls(self, text: str, pos: int, final: bool, calls: list[CallDraft]) -> None:
        while True:
            name_end = _NAME.match(text, pos).end()
            draft = CallDraft()
            calls.append(draft)
            if name_end >= len(text):
                return  # the name may go on
            name = self.known(text[pos:name_end])
            if text.startswith("{", name_end):  # [ARGS] skipped with the special tokens
                args_start: int | None = name_end
            elif "[CALL_ID]".startswith(text[name_end:]):
                return  # a call id or the arguments are next
            else:
                call_id = _CALL_ID.match(text, name_end)
                if call_id is not None:
                    if call_id.end() >= len(text):
                        return  # the id may go on
                    name_end = call_id.end()
                args_start = expect(text, name_end, self.ARGS)
            if args_start is None:
                return
            args = skip_space(text, args_start)
            if args >= len(text):
                draft.arguments = ""
                return
            if text[args] != "{":
                raise MalformedCall("arguments must be a JSON object")
            draft.name = name  # announced once its arguments surely are an object
            end = value_end(text, args, final)
            draft.arguments = text[args:end] if end is not None else text[args:]
            if end is None:
                return
            _check_object(draft.arguments)
            draft.done = True
            pos = skip_space(text, end)
            if text.startswith(self.START, pos):
                pos = skip_space(text, pos + len(self.START))
                continue
            next_end = _NAME.match(text, pos).end()
            if next_end == pos or next_end >= len(text) or text[next_end] != "{":
                return  # no further call (or its name is still being written)


def _check_object(arguments: str) -> None:
    try:
        value = json.loads(arguments)
    except ValueError:
        raise MalformedCall("arguments are no JSON") from None
    if not isinstance(value, dict):
        raise MalformedCall("arguments must be a JSON object")
