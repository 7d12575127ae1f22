"""The interface every tool-call format implements, and the streaming built on it.

A format only writes `scan(text, final)`: how much of the text is surely content, and the calls
begun so far, each with its name once the name is whole and its arguments as JSON text that
only grows (a format that does not write JSON converts each argument once it is whole). The
whole-text parse (`extract`) and the stream (`ToolCallStream`) both read the same scan, so a
stream's deltas add up to what the whole text parses to.

A call that is malformed (not the format's syntax, arguments that are no JSON object, a name
that is not a declared tool) or unfinished when the output ends leaves the whole text as
content: no call is returned for it."""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_json(self, index: int | None = None) -> dict:
        body = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return body if index is None else {"index": index, **body}


@dataclass(slots=True)
class CallDraft:
    """A call as far as the model has written it."""

    name: str | None = None  # once the name is whole (and a declared tool's)
    arguments: str = ""  # JSON text so far; a later scan's starts with this one's
    done: bool = False  # the call is closed and its arguments are a JSON object


@dataclass(slots=True)
class Scan:
    content_end: int  # text[:content_end] is surely content
    calls: list[CallDraft] = field(default_factory=list)
    failed: bool = False  # the text cannot be a well-formed list of calls


class MalformedCall(ValueError):
    """Raised inside a scan: the text breaks the format."""


class ToolParser(ABC):
    """Finds the tool calls in a model's own output format. `tools`: the declared functions
    (name -> definition, as `tools.tool_functions` gives them); a call of another name is
    malformed. None accepts any name."""

    def __init__(self, tools: dict[str, dict] | None = None) -> None:
        self.tools = tools

    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """The calls in `text`; `final`: the output is complete (a call still open is cut)."""

    def call_grammar(self) -> str | None:
        """EBNF that lets the output run free until a call opens and then keeps the call
        well-formed (`call_grammar` module); None where the format has none."""
        return None

    def known(self, name: str) -> str:
        """`name`, if it is a declared tool; MalformedCall otherwise."""
        if not name or (self.tools is not None and name not in self.tools):
            raise MalformedCall(f"no tool is named {name!r}")
        return name

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the text that is not tool calls, or None if empty; the calls, in order). A malformed
        or unfinished call leaves the whole text as content."""
        scan = self.scan(text, final=True)
        if scan.failed or not scan.calls or not all(c.done for c in scan.calls):
            return text, []
        content = text[: scan.content_end].strip()
        return content or None, [ToolCall(c.name, c.arguments) for c in scan.calls]

    def content_end(self, text: str) -> int:
        """While `text` is still growing: how much of it is surely content (streamable now)."""
        scan = self.scan(text, final=False)
        return len(text) if scan.failed else scan.content_end


def held_back(text: str, start: int, marker: str) -> int:
    """Where content ends in `text[start:]` when a call opens with `marker`: at the marker, or
    before a tail of the text that may be the marker's beginning."""
    found = text.find(marker, start)
    if found != -1:
        return found
    for keep in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[len(text) - keep :]):
            return len(text) - keep
    return len(text)


class ToolCallStream:
    """One streamed choice of an "auto" request: text in, OpenAI chat deltas out. Content goes
    out as soon as it surely is content; a call goes out as its id and name once, then its
    arguments' JSON text as it grows. When the text proves malformed (or ends inside a call),
    the rest of it goes out as content, as `extract` returns it whole; argument deltas already
    sent cannot be taken back (a grammar-constrained call never gets there)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.num_content_sent = 0
        self.calls: list[ToolCall] = []  # announced, with the arguments sent so far
        self.gave_up = False  # the text is malformed: everything is content from now on

    def feed(self, new_text: str, final: bool) -> list[dict]:
        self.text += new_text
        if self.gave_up:
            return self._rest_as_content()
        scan = self.parser.scan(self.text, final)
        cut = final and (not scan.calls or not all(c.done for c in scan.calls))
        if scan.failed or (cut and scan.calls):
            self.gave_up = True
            return self._rest_as_content()
        end = len(self.text) if final and not scan.calls else scan.content_end
        deltas = []
        if end > self.num_content_sent and not self.calls:
            deltas.append({"content": self.text[self.num_content_sent : end]})
            self.num_content_sent = end
        for index, draft in enumerate(scan.calls):
            if draft.name is None:
                break
            if index == len(self.calls):
                call = ToolCall(draft.name, "")
                self.calls.append(call)
                deltas.append({"tool_calls": [call.to_json(index=index)]})
            call = self.calls[index]
            if len(draft.arguments) > len(call.arguments):
                piece = draft.arguments[len(call.arguments) :]
                call.arguments = draft.arguments
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        return deltas

    @property
    def called(self) -> bool:
        """Whether the stream ended with calls (not given up)."""
        return bool(self.calls) and not self.gave_up

    def _rest_as_content(self) -> list[dict]:
        rest = self.text[self.num_content_sent :]
        self.num_content_sent = len(self.text)
        return [{"content": rest}] if rest else []
