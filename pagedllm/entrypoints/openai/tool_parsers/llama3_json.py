"""Llama 3.1-3.3's JSON calls: `{"name": ..., "parameters": {...}}` (or "arguments"), after
`<|python_tag|>` or as the whole answer, several separated by `;`."""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.base import CallDraft, MalformedCall, Scan, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.call_grammar import each_tool, grammar_text, json_call, leading_or_tagged, separated
from pagedllm.entrypoints.openai.tool_parsers.text_scan import call_object, skip_space, tag_or_leading


class Llama3JsonToolParser(ToolParser):
    TAG = "<|python_tag|>"

    def call_grammar(self) -> str | None:
        """Calls as Llama's templates ask for them, `{"name": ..., "parameters": {...}}`, `; `
        between them, as the answer or after the tag."""
        call = json_call(lambda name: f'{{"name": {json.dumps(name)}, "parameters": ')
        return grammar_text(lambda: leading_or_tagged("{", separated(each_tool(self.tools, call), "; "), self.TAG))

    def scan(self, text: str, final: bool) -> Scan:
        opened = tag_or_leading(text, self.TAG, "{")
        if isinstance(opened, int):
            return Scan(opened)  # no call yet
        start, pos = opened
        scan = Scan(start)
        try:
            while True:
                pos = skip_space(text, pos)
                if pos >= len(text):
                    if not scan.calls:
                        scan.calls.append(CallDraft())
                    break
                draft, end = call_object(self, text, pos, final)
                scan.calls.append(draft)
                if end is None:
                    break
                pos = skip_space(text, end)
                if not text.startswith(";", pos):
                    break  # what follows the calls is not content (and not a call)
                pos += 1
        except MalformedCall:
            scan.failed = True
        return scan
