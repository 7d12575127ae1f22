"""Tool-call parsers, one module per model family's format, under vLLM's names
(`--tool-call-parser NAME`). Each is a `ToolParser`: `extract` parses a whole output, and
`ToolCallStream` streams one (content deltas, then each call's id and name once and its
arguments' JSON text as it grows)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.base import CallDraft, MalformedCall, Scan, ToolCall, ToolCallStream, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from pagedllm.entrypoints.openai.tool_parsers.phi4_mini_json import Phi4MiniJsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from pagedllm.entrypoints.openai.tool_parsers.qwen3_xml import Qwen3XmlToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,  # vLLM's name for Llama 4's JSON calls, the same format
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "llama4_pythonic": PythonicToolParser,  # vLLM's name for Llama 4's (<|python_start|> ... <|python_end|>)
    "qwen3_xml": Qwen3XmlToolParser,
    "qwen3_coder": Qwen3XmlToolParser,  # vLLM's other name for it
    "phi4_mini_json": Phi4MiniJsonToolParser,
}

__all__ = [
    "TOOL_PARSERS", "CallDraft", "MalformedCall", "Scan", "ToolCall", "ToolCallStream", "ToolParser",
    "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser", "Phi4MiniJsonToolParser",
    "PythonicToolParser", "Qwen3XmlToolParser",
]
