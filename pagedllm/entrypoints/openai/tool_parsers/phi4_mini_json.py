"""Phi-4-mini's calls: `functools[{"name": ..., "arguments": {...}}, ...]`."""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.base import CallDraft, MalformedCall, Scan, ToolParser, held_back
from pagedllm.entrypoints.openai.tool_parsers.call_grammar import structural_tag_grammar
from pagedllm.entrypoints.openai.tool_parsers.text_scan import call_array


class Phi4MiniJsonToolParser(ToolParser):
    START = "functools["

    def call_grammar(self) -> str | None:
        """One call per `functools[...]` (parallel calls: one list after another)."""
        head = self.START + '{{"name": {}, "arguments": '
        return structural_tag_grammar(self.tools, self.START, lambda name: head.format(json.dumps(name)), "}]")

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(self.START)
        if start == -1:
            return Scan(held_back(text, 0, self.START))
        scan = Scan(start)
        try:
            call_array(self, text, start + len(self.START), final, scan.calls, ("arguments", "parameters"))
        except MalformedCall:
            scan.failed = True
        if not scan.calls:
            scan.calls.append(CallDraft())
        return scan
