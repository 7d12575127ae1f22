"""A request's structured-output spec as an xgrammar grammar, parsed (which is where a bad spec
is found, with a message naming the field) and compiled against the model's vocabulary.

Compiling precomputes, for every grammar state, which vocabulary tokens it accepts: milliseconds
to seconds depending on the grammar, so the engine runs it on a thread of its own and caches
the result by spec."""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from pagedllm.sampling_params import StructuredOutputsParams

# xgrammar's C++ errors start with a timestamp, a source location and the failed check.
_NOISE = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: .*? is false: )?")


class InvalidConstraintError(ValueError):
    """A spec that is not a valid schema, regex or grammar; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _clean(exc: Exception) -> str:
    return _NOISE.sub("", str(exc).strip()).strip()


def parse_spec(spec: StructuredOutputsParams) -> xgr.Grammar:
    """The grammar of `spec`; an `InvalidConstraintError` naming the field if it has none."""
    kind = spec.kind
    what = {"json": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar"}.get(kind, kind)
    param = spec.param
    if kind == "json":
        try:
            value = spec.json if not isinstance(spec.json, str) else json.loads(spec.json)
        except ValueError:
            value = None  # not JSON: xgrammar's parse below names what is wrong
        unenforced = _unenforced_keyword(value)
        if unenforced is not None:
            raise InvalidConstraintError(
                f"The JSON schema in {param} uses {unenforced}, which xgrammar (the grammar engine) does not "
                "enforce: outputs could break it. Leave it out (and check it in your code), or express it "
                "otherwise (one schema instead of an allOf of several).", param)
    try:
        if kind == "json":
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            return xgr.Grammar.from_json_schema(schema, any_whitespace=not spec.disable_any_whitespace, strict_mode=True)
        if kind == "json_object":  # any JSON object, as OpenAI's json_object mode promises
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=not spec.disable_any_whitespace, strict_mode=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            # Each choice as an EBNF string literal; JSON's escapes are also EBNF's.
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidConstraintError(f"The {what} in {param} is invalid: {_clean(exc)}", param) from None


# Schema keywords xgrammar 0.2 accepts and then ignores (checked on its matcher: `not`, an allOf of
# two schemas, uniqueItems, dependentRequired, if/then all let through values they forbid): a
# schema using them is refused, as vLLM refuses the features its xgrammar backend lacks.
_IGNORED_KEYWORDS = ("not", "uniqueItems", "dependentRequired", "dependentSchemas", "dependencies", "if",
                     "unevaluatedProperties", "unevaluatedItems")
# Keywords whose values are data, not schemas: not looked into.
_DATA_KEYWORDS = ("enum", "const", "default", "examples", "description", "title")
# Keywords whose values map names (of properties, of definitions) to schemas.
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions")


def _unenforced_keyword(schema: object) -> str | None:
    """`KEYWORD at PATH` for the first keyword of `schema` xgrammar would ignore; None if none."""
    stack = [(schema, "$")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        for keyword in _IGNORED_KEYWORDS:
            if keyword in node and not (keyword == "uniqueItems" and node[keyword] is False):
                return f"{keyword!r} at {path}"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return f"'allOf' of {len(node['allOf'])} schemas at {path}"
        for key, value in node.items():
            if key in _NAMED_SCHEMAS and isinstance(value, dict):  # names, then a schema each
                stack.extend((sub, f"{path}.{key}.{name}") for name, sub in value.items())
            elif key not in _DATA_KEYWORDS:
                stack.append((value, f"{path}.{key}"))
    return None


class GrammarCompiler:
    """xgrammar's compiler for one model's vocabulary (its tokens' bytes and stop ids)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_threads: int = 1) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        # xgrammar keeps its own cache too; ours (by spec, in the engine) also spans failures.
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        grammar = parse_spec(spec)
        # Found before the compile's seconds are spent (a choice, of non-empty strings, always has
        # one; its check would read 0.3 s of a 30,000-string grammar).
        if spec.kind != "choice" and _derives_a_string(grammar) is False:
            raise _accepts_no_string(spec)
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except RuntimeError as exc:
            raise InvalidConstraintError(f"{spec.field_name} could not be compiled: {_clean(exc)}", spec.field_name) from None
        if not _accepts_a_first_token(compiled, self.vocab_size):
            raise _accepts_no_string(spec)
        return compiled


def _accepts_no_string(spec: StructuredOutputsParams) -> InvalidConstraintError:
    return InvalidConstraintError(
        f"The {spec.kind} in {spec.param} accepts no string: every way through it leads back to a part still being "
        "expanded, so no text ever completes it (as in the grammar `root ::= root root` or `r ::= \"y\" r`, or a "
        "schema whose object requires itself); give one that some text satisfies.",
        spec.param,
    )


def _accepts_a_first_token(compiled: xgr.CompiledGrammar, vocab_size: int) -> bool:
    """Whether any token may start the output (or the empty output is complete): a grammar
    whose language is empty would otherwise be sampled from a row with every token masked."""
    matcher = xgr.GrammarMatcher(compiled)
    if matcher.is_terminated():
        return True
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


# xgrammar's serialized expressions (`Grammar.serialize_json`, format "v18"): each is
# [type, number of items, items...]; the types below, the rest (tag dispatch) taken as able to end.
_BYTES, _CLASS, _CLASS_STAR, _EMPTY, _RULE, _SEQUENCE, _CHOICES, _REPEAT = 0, 1, 2, 3, 4, 5, 6, 8
_FORMAT = "v18"
WALK_LIMIT = 300_000  # expressions looked at: ~0.3 s of Python at most


def _derives_a_string(grammar: xgr.Grammar) -> bool | None:
    """Whether the grammar's root derives some finite string: the rules that can end, found by
    the textbook fixed point (a rule ends if one of its choices is a sequence of parts that all
    end), each rule looked at again only when a rule it names is found to end. None where it
    cannot tell: xgrammar's serialized form is not the one read here, or the grammar is nested or
    tangled past WALK_LIMIT expressions looked at (the compile's first-token check still runs)."""
    data = json.loads(grammar.serialize_json())
    if data.get("__VERSION__") != _FORMAT:
        return None
    flat, starts = data["grammar_expr_data"], data["grammar_expr_indptr"]
    exprs = [flat[begin:end] for begin, end in zip(starts, [*starts[1:], len(flat)])]  # (starts only)
    bodies = [rule[1] for rule in data["rules"]]
    ends = [False] * len(bodies)
    budget = [WALK_LIMIT]

    def can_end(index: int) -> bool:
        budget[0] -= 1
        if budget[0] < 0:
            raise RecursionError
        kind, items = exprs[index][0], exprs[index][2:]
        if kind == _RULE:
            return ends[items[0]]
        if kind == _SEQUENCE:
            return all(can_end(i) for i in items)
        if kind == _CHOICES:
            return any(can_end(i) for i in items)
        if kind == _REPEAT:  # [rule, least, most]
            return items[1] == 0 or ends[items[0]]
        return True  # bytes, character classes, the empty string, a tag dispatch

    dependents: list[set[int]] = [set() for _ in bodies]
    for rule, body in enumerate(bodies):
        stack = [body]
        while stack:
            kind, items = exprs[stack[-1]][0], exprs[stack.pop()][2:]
            if kind in (_RULE, _REPEAT):
                dependents[items[0]].add(rule)
            elif kind in (_SEQUENCE, _CHOICES):
                stack.extend(items)
    todo = list(range(len(bodies)))
    try:
        while todo:
            rule = todo.pop()
            if not ends[rule] and can_end(bodies[rule]):
                ends[rule] = True
                todo.extend(dependents[rule])
    except RecursionError:
        return None
    return ends[data["root_rule_id"]]
