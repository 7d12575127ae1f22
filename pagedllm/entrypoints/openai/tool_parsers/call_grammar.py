"""The grammar that keeps "auto" calls well-formed (beyond vLLM): the output is free until the
model writes its family's call-opening text (the trigger), and from there the rest of the call
is constrained to a call of a declared tool with arguments valid for its schema, in the exact
form the parser reads; once the call closes, the output is free again (another call may open).

It is xgrammar's structural-tag grammar (a `TagDispatch` over the triggers), written out as
EBNF so that it travels as an ordinary `grammar` constraint: the engine compiles and caches it
like any other, and the reasoning gate holds it back while a model thinks."""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import Callable

from pagedllm.entrypoints.openai.tool_parsers.text_scan import WHITESPACE


def structural_tag_grammar(
    tools: dict[str, dict], trigger: str, begin: Callable[[str], str], end: str, style: str = "json"
) -> str | None:
    """EBNF for calls opened by `trigger`: for each tool, `begin(name)`, the tool's parameters,
    then `end`. The parameters are compact JSON (`", "` and `": "` between tokens, no other
    whitespace: no runs of it for a model to wander into), or with `style` "qwen_xml"
    `<parameter=KEY>value</parameter>` blocks (xgrammar's). None when a schema is one xgrammar
    cannot turn into a grammar (the calls are then parsed, not constrained)."""

    def build():
        from xgrammar.structural_tag import JSONSchemaFormat, TagFormat, TriggeredTagsFormat

        tags = []
        for name, function in tools.items():
            opening = begin(name)
            assert opening.startswith(trigger)
            content = compact_json(function["parameters"]) if style == "json" else JSONSchemaFormat(
                json_schema=function["parameters"], style=style)
            tags.append(TagFormat(begin=opening, content=content, end=end))
        return TriggeredTagsFormat(triggers=[trigger], tags=tags)

    return grammar_text(build)


def leading_or_tagged(opening: str, calls, tag: str, tagged_calls=None, tag_end: str = ""):
    """The format of the families whose calls are the whole answer when it opens with `opening`
    (`{`, `[`), or follow `tag` (a special token's text: xgrammar matches the token by its text)
    anywhere: the answer is (after any whitespace) `calls`; or `tag`, `tagged_calls` (`calls`
    if None) and an optional `tag_end`; or free text up to the tag, then as before; or free text
    without the tag. Free text starts with neither `opening` nor the tag (nor, where the tag
    starts otherwise, its first character twice or its first two characters). Once the calls
    close, the answer ends."""
    from xgrammar.structural_tag import AnyTextFormat, ConstStringFormat, GrammarFormat, OptionalFormat, OrFormat, SequenceFormat

    after_tag = [ConstStringFormat(value=tag), tagged_calls or calls]
    if tag_end:
        after_tag.append(OptionalFormat(content=ConstStringFormat(value=tag_end)))
    space = GrammarFormat(grammar=f"root ::= [{_class(WHITESPACE)}]*")
    free = AnyTextFormat(excludes=[tag])
    # Free text's first characters: consumed before `free` looks for the tag, so they must not begin it.
    starts = [SequenceFormat(elements=[GrammarFormat(grammar=f"root ::= [{_class(WHITESPACE)}]* [^{_class(WHITESPACE + opening + tag[0])}]")])]
    if tag[0] != opening:
        starts.append(SequenceFormat(elements=[space, ConstStringFormat(value=tag[0]), GrammarFormat(grammar=f"root ::= [^{_class(tag[:2])}]")]))
    alternatives = [SequenceFormat(elements=[space, calls]), SequenceFormat(elements=[space, *after_tag])]
    for start in starts:
        alternatives += [SequenceFormat(elements=[start, free, *after_tag]), SequenceFormat(elements=[start, free])]
    if tag[0] != opening:
        alternatives.append(SequenceFormat(elements=[space, ConstStringFormat(value=tag[0])]))
    return OrFormat(elements=[*alternatives, space])


def _class(chars: str) -> str:
    """`chars` inside an EBNF character class."""
    named = {"\t": "\\t", "\r": "\\r", "\n": "\\n", "\f": "\\f", "\v": "\\v"}
    return "".join(named.get(c, "\\" + c if c in "[]\\^-" else c) for c in dict.fromkeys(chars))


def grammar_text(build: Callable[[], object]) -> str | None:
    """The EBNF of the structural-tag format `build()` returns; None when xgrammar cannot make it
    (a schema it cannot turn into a grammar: the calls are then parsed, not constrained)."""
    import xgrammar as xgr
    from xgrammar.structural_tag import StructuralTag

    try:
        return str(xgr.Grammar.from_structural_tag(StructuralTag(format=build())))
    except (RuntimeError, ValueError, TypeError):
        return None


def compact_json(schema: dict):
    """The format of a JSON value valid for `schema`, compact (`", "` and `": "` between tokens,
    no other whitespace: no runs of it for a model to wander into)."""
    import xgrammar as xgr
    from xgrammar.structural_tag import GrammarFormat

    return GrammarFormat(grammar=str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)))


def python_literal(schema: dict):
    """The format of a Python literal whose value is valid for `schema` (JSON's grammar, with
    True, False and None for its literals: `ast.literal_eval` reads the rest alike)."""
    from xgrammar.structural_tag import GrammarFormat

    grammar = compact_json(schema).grammar
    for json_word, python_word in (("true", "True"), ("false", "False"), ("null", "None")):
        grammar = grammar.replace(f'"{json_word}"', f'"{python_word}"')
    return GrammarFormat(grammar=grammar)


def each_tool(tools: dict[str, dict], call: Callable[[str, dict], object]):
    """One of the tools' calls: `call(name, parameters schema)` for each."""
    from xgrammar.structural_tag import OrFormat

    calls = [call(name, function["parameters"]) for name, function in tools.items()]
    return calls[0] if len(calls) == 1 else OrFormat(elements=calls)


def separated(item, separator: str, before: str = "", after: str = ""):
    """`before`, one or more `item`s with `separator` between them, `after`."""
    from xgrammar.structural_tag import ConstStringFormat, SequenceFormat, StarFormat

    more = StarFormat(content=SequenceFormat(elements=[ConstStringFormat(value=separator), item]))
    elements = [ConstStringFormat(value=before)] if before else []
    elements += [item, more] + ([ConstStringFormat(value=after)] if after else [])
    return SequenceFormat(elements=elements)


def json_call(head: Callable[[str], str], tail: str = "}") -> Callable[[str, dict], object]:
    """A call written as `head(name)`, the arguments as compact JSON, then `tail`."""
    from xgrammar.structural_tag import ConstStringFormat, SequenceFormat

    def call(name: str, schema: dict):
        elements = [ConstStringFormat(value=head(name)), compact_json(schema)]
        return SequenceFormat(elements=elements + ([ConstStringFormat(value=tail)] if tail else []))

    return call


def python_call(name: str, schema: dict):
    """`name(keyword=literal, ...)` with the schema's properties as keywords: the required ones
    first, in the schema's order, then any of the others in order; any keywords where the schema
    names none and does not forbid them. One EBNF of rules shared between the choices (its size
    grows with the properties, not with the ways to pick among them)."""
    from xgrammar.structural_tag import GrammarFormat

    properties = schema.get("properties") or {}
    required = [key for key in schema.get("required") or () if key in properties]
    if any(not key.isidentifier() for key in required):
        raise ValueError(f"{name} requires an argument that is no Python keyword")
    optional = [key for key in properties if key not in required and key.isidentifier()]
    keys = required + optional
    rules = [_prefixed(python_literal(properties[key]).grammar, f"v{i}_") for i, key in enumerate(keys)]
    n = len(keys)
    # then_i: the optional keywords from the i-th on, each after a comma; first_i: the same when
    # none came before (the first one given has no comma).
    rules += [f"then_{i} ::= {_text(', ' + keys[i] + '=')} v{i}_root then_{i + 1} | then_{i + 1}" for i in range(len(required), n)]
    rules += [f"first_{i} ::= {_text(keys[i] + '=')} v{i}_root then_{i + 1} | first_{i + 1}" for i in range(len(required), n)]
    rules += [f"then_{n} ::= \"\"", f"first_{n} ::= \"\""]
    if required:
        head = " ".join(f"{_text((', ' if i else '') + key + '=')} v{i}_root" for i, key in enumerate(required))
        arguments = f"{head} then_{len(required)}"
    elif optional:
        arguments = "first_0"
    elif not properties and schema.get("additionalProperties") is not False:  # any keywords
        rules.append(_prefixed(python_literal({}).grammar, "any_"))
        rules.append('keyword ::= [A-Za-z_] [A-Za-z0-9_]* "=" any_root')
        arguments = '(keyword (", " keyword)*)?'
    else:
        arguments = '""'
    return GrammarFormat(grammar="\n".join([f"root ::= {_text(name + '(')} {arguments} {_text(')')}", *rules]))


# A token of xgrammar's printed EBNF: a string literal, a character class, a name, anything else.
_EBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*|.', re.S)


def _prefixed(grammar: str, prefix: str) -> str:
    """xgrammar's printed `grammar` with every rule name prefixed (to sit beside others in one)."""
    return "".join(prefix + t if t[0].isalpha() or t[0] == "_" else t for t in _EBNF_TOKEN.findall(grammar))


def _text(text: str) -> str:
    """`text` as an EBNF string literal (JSON's escapes are EBNF's)."""
    return json.dumps(text, ensure_ascii=False)


async def constrain_auto_calls(params, parser) -> None:
    """Give an "auto" request's sampling `params` the parser's call grammar, unless the request
    already constrains its output (response_format, structured_outputs) or the format has none.
    The grammar is built on a worker thread: thousands of tools take seconds (3,000 in the
    `mistral` format: 6 s), which the event loop would spend away from every other request."""
    from pagedllm.sampling_params import StructuredOutputsParams

    if params.structured_outputs is not None or parser.tools is None:
        return
    grammar = await asyncio.to_thread(_call_grammar, type(parser), json.dumps(parser.tools))
    if grammar is not None:
        params.structured_outputs = StructuredOutputsParams(grammar=grammar, field_name="tools")


@functools.lru_cache(maxsize=64)
def _call_grammar(parser_class: type, tools_json: str) -> str | None:
    """The grammar of a parser for the tools (as JSON text): agents send the same tools with
    every request, and building it takes milliseconds on the server's event loop."""
    return parser_class(json.loads(tools_json)).call_grammar()
