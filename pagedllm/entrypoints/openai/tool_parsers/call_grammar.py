"""The grammar that keeps "auto" calls well-formed (beyond vLLM): the output is free until the
model writes its family's call-opening text (the trigger), and from there the rest of the call
is constrained to a call of a declared tool with arguments valid for its schema, in the exact
form the parser reads; once the call closes, the output is free again (another call may open).

It is xgrammar's structural-tag grammar (a `TagDispatch` over the triggers), written out as
EBNF so that it travels as an ordinary `grammar` constraint: the engine compiles and caches it
like any other, and the reasoning gate holds it back while a model thinks."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable


def structural_tag_grammar(
    tools: dict[str, dict], trigger: str, begin: Callable[[str], str], end: str, style: str = "json"
) -> str | None:
    """EBNF for calls opened by `trigger`: for each tool, `begin(name)`, the tool's parameters,
    then `end`. The parameters are compact JSON (`", "` and `": "` between tokens, no other
    whitespace: no runs of it for a model to wander into), or with `style` "qwen_xml"
    `<parameter=KEY>value</parameter>` blocks (xgrammar's). None when a schema is one xgrammar
    cannot turn into a grammar (the calls are then parsed, not constrained)."""
    import xgrammar as xgr
    from xgrammar.structural_tag import GrammarFormat, JSONSchemaFormat, StructuralTag, TagFormat, TriggeredTagsFormat

    try:
        tags = []
        for name, function in tools.items():
            opening = begin(name)
            assert opening.startswith(trigger)
            if style == "json":
                schema = json.dumps(function["parameters"])
                content = GrammarFormat(grammar=str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)))
            else:
                content = JSONSchemaFormat(json_schema=function["parameters"], style=style)
            tags.append(TagFormat(begin=opening, content=content, end=end))
        tag = StructuralTag(format=TriggeredTagsFormat(triggers=[trigger], tags=tags))
        return str(xgr.Grammar.from_structural_tag(tag))
    except (RuntimeError, ValueError, TypeError):
        return None


def constrain_auto_calls(params, parser) -> None:
    """Give an "auto" request's sampling `params` the parser's call grammar, unless the request
    already constrains its output (response_format, structured_outputs) or the format has none."""
    from pagedllm.sampling_params import StructuredOutputsParams

    if params.structured_outputs is not None or parser.tools is None:
        return
    grammar = _call_grammar(type(parser), json.dumps(parser.tools))
    if grammar is not None:
        params.structured_outputs = StructuredOutputsParams(grammar=grammar, field_name="tools")


@functools.lru_cache(maxsize=64)
def _call_grammar(parser_class: type, tools_json: str) -> str | None:
    """The grammar of a parser for the tools (as JSON text): agents send the same tools with
    every request, and building it takes milliseconds on the server's event loop."""
    return parser_class(json.loads(tools_json)).call_grammar()
