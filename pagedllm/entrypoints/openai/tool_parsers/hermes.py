"""Hermes (Qwen 2.5/3, Hermes, and many others): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call; content only before the first. A last call left unclosed still counts when
its JSON is whole (models often stop at the JSON's end)."""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.base import CallDraft, MalformedCall, Scan, ToolParser, held_back
from pagedllm.entrypoints.openai.tool_parsers.call_grammar import structural_tag_grammar
from pagedllm.entrypoints.openai.tool_parsers.text_scan import call_object, expect, skip_space


class HermesToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"

    def call_grammar(self) -> str | None:
        """A call as Qwen's templates write it: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""
        head = self.START + '\n{{"name": {}, "arguments": '
        return structural_tag_grammar(self.tools, self.START, lambda name: head.format(json.dumps(name)), "}\n" + self.END)

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(self.START)
        if start == -1:
            return Scan(held_back(text, 0, self.START))
        scan = Scan(start)
        try:
            pos = start
            while pos != -1:
                body = skip_space(text, pos + len(self.START))
                if body >= len(text):
                    scan.calls.append(CallDraft())
                    break
                draft, end = call_object(self, text, body, final)
                scan.calls.append(draft)
                if end is None:
                    break
                after = skip_space(text, end)
                if after >= len(text) or expect(text, after, self.END) is None:
                    break  # the closing tag is still to come (or never comes: the call counts)
                pos = text.find(self.START, after)
        except MalformedCall:
            scan.failed = True
        return scan
