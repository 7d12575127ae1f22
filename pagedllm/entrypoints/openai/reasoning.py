"""Reasoning parsers (`--reasoning-parser`, vLLM's names): a thinking model's output split into its
reasoning (the text between `<think>` and `</think>`, or its family's tags) and its answer.

Every family here marks its thinking with a start and an end tag, and differs only in where the
output begins: `deepseek_r1`'s template opens thinking in the prompt, so its output is reasoning
up to `</think>` even without a start tag; the others (`qwen3`, `glm45`, `deepseek_v3`,
`mistral`) think only if the output opens a start tag, and otherwise answer at once. Either way
the prompt settles it when it ends with a tag: a template that ends the prompt with `<think>`
(Qwen3.5, R1-0528) opens thinking, one that ends it with `</think>` (`enable_thinking: false`)
closes it, so the whole output is the answer.

A request's output goes through one state machine, `ReasoningSplitter`, whether streamed or not,
so both give the same split: text before the start tag is answer, text after it is reasoning
until the end tag, and the rest is answer. A tag cut across deltas is held back until it is
whole (or proven not to be one). An output that ends while thinking is all reasoning.

The engine side (`StructuredOutputsParams.reasoning_end_token_ids`): a grammar (structured
outputs, a forced tool call) does not constrain the thinking and starts at the token after the
end tag, as vLLM does; a parser whose thinking is optional lets the first token open it.

Use (the chat route; the Anthropic and Responses routes the same way):

    thinking = parser.for_prompt(prompt_token_ids)   # once per request
    thinking.constrain(params)                       # the grammar waits for the reasoning
    reasoning, content = thinking.split(text)        # a finished output (None where empty)
    splitter = thinking.splitter()                   # per streamed choice:
    reasoning_delta, content_delta = splitter.feed(delta_text, final=finished)
    thinking.num_reasoning_tokens(token_ids)         # usage's reasoning_tokens

Nothing heavy is imported: the launch flags read the parsers' names from here.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import logging
from dataclasses import dataclass

from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


class Phase(enum.Enum):
    """Where a splitter is in the output."""

    BEFORE = "before"  # not thinking yet: a start tag opens the reasoning
    THINKING = "thinking"  # reasoning, until the end tag
    ANSWER = "answer"  # the rest is content


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    start: str
    end: str
    opens_in_prompt: bool  # the template opens thinking: the output is reasoning from its start


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("<think>", "</think>", opens_in_prompt=True),
    "qwen3": ReasoningFormat("<think>", "</think>", opens_in_prompt=False),
    "glm45": ReasoningFormat("<think>", "</think>", opens_in_prompt=False),
    "deepseek_v3": ReasoningFormat("<think>", "</think>", opens_in_prompt=False),
    "mistral": ReasoningFormat("[THINK]", "[/THINK]", opens_in_prompt=False),
}
REASONING_PARSERS = tuple(REASONING_FORMATS)
# llama-server's --reasoning-format values: "none" parses nothing; the others pick the parser
# from the chat template once it is loaded (AUTO).
LLAMA_REASONING_FORMATS = ("none", "auto", "deepseek")
AUTO = "auto"
# The prompt's last tokens decoded to see whether it ends with a tag (and whitespace).
PROMPT_TAIL_TOKENS = 32


def auto_parser_name(chat_template: str | None) -> str:
    """The parser llama-server's `--reasoning-format auto/deepseek` means for a chat template:
    Mistral's `[THINK]` tags if the template names them, else `<think>` tags, reasoning only
    where the output or the prompt opens them (a template that opens thinking in the prompt is
    seen in each request's prompt)."""
    return "mistral" if "[THINK]" in (chat_template or "") else "qwen3"


def _held_tail(text: str, tag: str) -> int:
    """How many of `text`'s last characters may begin `tag` (held back until the next piece)."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0


class ReasoningSplitter:
    """One output's text, fed in pieces, split into reasoning and content (see the module's
    doc). `feed` returns what each gained; the final piece (`final=True`) releases all held text."""

    def __init__(self, fmt: ReasoningFormat, phase: Phase) -> None:
        self.start, self.end = fmt.start, fmt.end
        self.phase = phase
        self.thought = phase is not Phase.BEFORE  # whether reasoning has begun
        self._leading = phase is Phase.THINKING  # a start tag leading the thinking is dropped
        self._held = ""

    @property
    def reasoning_ended(self) -> bool:
        return self.phase is Phase.ANSWER

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) that `text` completes."""
        buf = self._held + text
        reasoning: list[str] = []
        content: list[str] = []
        while buf:
            if self.phase is Phase.ANSWER:
                content.append(buf)
                buf = ""
            elif self.phase is Phase.THINKING:
                if self._leading:  # the model may write the start tag the prompt already opened
                    stripped = buf.lstrip()
                    if stripped.startswith(self.start):
                        buf = stripped[len(self.start):]
                        self._leading = False
                        continue
                    if not final and self.start.startswith(stripped):  # whitespace or a partial tag
                        break
                    self._leading = False
                at = buf.find(self.end)
                if at >= 0:
                    reasoning.append(buf[:at])
                    buf = buf[at + len(self.end):]
                    self.phase = Phase.ANSWER
                    continue
                keep = 0 if final else _held_tail(buf, self.end)
                reasoning.append(buf[: len(buf) - keep])
                buf = buf[len(buf) - keep:]
                break
            else:  # BEFORE
                at = buf.find(self.start)
                if at >= 0:
                    content.append(buf[:at])
                    buf = buf[at + len(self.start):]
                    self.phase, self.thought = Phase.THINKING, True
                    continue
                keep = 0 if final else _held_tail(buf, self.start)
                content.append(buf[: len(buf) - keep])
                buf = buf[len(buf) - keep:]
                break
        self._held = buf
        return "".join(reasoning), "".join(content)


class RequestReasoning:
    """A parser bound to one request's prompt: where its output begins (`phase`)."""

    def __init__(self, parser: "ReasoningParser", phase: Phase) -> None:
        self.parser = parser
        self.phase = phase

    def splitter(self) -> ReasoningSplitter:
        """A fresh splitter for one choice of the request."""
        return ReasoningSplitter(self.parser.format, self.phase)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output, each None when empty."""
        reasoning, content = self.splitter().feed(text, final=True)
        return reasoning or None, content or None

    def constrain(self, params: SamplingParams) -> None:
        """Hold the request's grammar (structured outputs, a forced tool call) back until the
        reasoning ends. A grammar applies from the first token when the prompt closed thinking,
        or when thinking is optional and its start tag is not one token (the first step cannot
        then offer it beside the grammar's tokens)."""
        spec = params.structured_outputs
        parser = self.parser
        if spec is None or self.phase is Phase.ANSWER:
            return
        start = None
        if self.phase is Phase.BEFORE:
            if len(parser.start_token_ids) != 1:
                return
            start = parser.start_token_ids[0]
        params.structured_outputs = dataclasses.replace(
            spec, reasoning_end_token_ids=list(parser.end_token_ids), reasoning_start_token_id=start
        )

    def num_reasoning_tokens(self, token_ids: list[int]) -> int:
        """The output's tokens up to the end of its reasoning, end tag included (all of them if
        it never ended; none if it never thought)."""
        if self.phase is Phase.ANSWER or not token_ids:
            return 0
        parser = self.parser
        begin = 0
        if self.phase is Phase.BEFORE:
            opened = _find(token_ids, parser.start_token_ids, 0)
            begin = opened + len(parser.start_token_ids) if opened is not None else None
        if begin is not None:
            end = _find(token_ids, parser.end_token_ids, begin)
            if end is not None:
                return end + len(parser.end_token_ids)
        # The tags are not in the ids as the tokenizer writes them: read the text instead.
        splitter = self.splitter()
        splitter.feed(parser.decode(token_ids), final=True)
        if not splitter.thought:
            return 0
        if not splitter.reasoning_ended:
            return len(token_ids)
        low, high = 1, len(token_ids)  # the shortest prefix whose text ends the reasoning
        while low < high:
            middle = (low + high) // 2
            prefix = self.splitter()
            prefix.feed(parser.decode(token_ids[:middle]))
            if prefix.reasoning_ended:
                high = middle
            else:
                low = middle + 1
        return low


def _find(token_ids: list[int], needle: list[int], begin: int) -> int | None:
    """Where `needle` first occurs in `token_ids` at or after `begin`."""
    if not needle:
        return None
    at = begin
    while True:
        try:
            at = token_ids.index(needle[0], at)
        except ValueError:
            return None
        if list(token_ids[at: at + len(needle)]) == list(needle):
            return at
        at += 1


class ReasoningParser:
    """A served model's reasoning format, with its tags as token ids. It keeps a tokenizer copy
    of its own (decoding a prompt's last tokens, and the rare output whose tags were tokenized
    otherwise): use it from one thread, the server's event loop."""

    def __init__(self, name: str, tokenizer) -> None:
        if name not in REASONING_FORMATS:
            raise ValueError(f"Unknown reasoning parser {name!r}; the parsers are: {', '.join(REASONING_PARSERS)}.")
        self.name = name
        self.format = REASONING_FORMATS[name]
        self._tokenizer = copy.deepcopy(tokenizer)
        self.start_token_ids = self._tokenizer.encode(self.format.start, add_special_tokens=False)
        self.end_token_ids = self._tokenizer.encode(self.format.end, add_special_tokens=False)
        special = set(getattr(self._tokenizer, "all_special_tokens", ()))
        hidden = [tag for tag in (self.format.start, self.format.end) if tag in special]
        if hidden:
            logger.warning(
                "The reasoning tags %s are special tokens of this tokenizer, left out of the text unless a request "
                "sends skip_special_tokens: false; the %s parser finds them only then.", hidden, name,
            )

    @classmethod
    def for_server(cls, name: str | None, tokenizer) -> "ReasoningParser | None":
        """The parser `--reasoning-parser NAME` (or llama-server's `--reasoning-format`, AUTO)
        names for a served tokenizer; None for none."""
        if name is None:
            return None
        if name == AUTO:
            name = auto_parser_name(getattr(tokenizer, "chat_template", None))
        return cls(name, tokenizer)

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)

    def for_prompt(self, prompt_token_ids: list[int]) -> RequestReasoning:
        """Where the output of a prompt begins: thinking if the prompt ends with the start tag,
        the answer if it ends with the end tag, else as the format has it."""
        tail = self.decode(prompt_token_ids[-PROMPT_TAIL_TOKENS:]).rstrip()
        if tail.endswith(self.format.start):
            phase = Phase.THINKING
        elif tail.endswith(self.format.end):
            phase = Phase.ANSWER
        else:
            phase = Phase.THINKING if self.format.opens_in_prompt else Phase.BEFORE
        return RequestReasoning(self, phase)
