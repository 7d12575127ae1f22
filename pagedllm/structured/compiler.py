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


class GrammarCompiler:
    """xgrammar's compiler for one model's vocabulary (its tokens' bytes and stop ids)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_threads: int = 1) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        # xgrammar keeps its own cache too; ours (by spec, in the engine) also spans failures.
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        grammar = parse_spec(spec)
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except RuntimeError as exc:
            raise InvalidConstraintError(f"{spec.field_name} could not be compiled: {_clean(exc)}", spec.field_name) from None
        if not _accepts_a_first_token(compiled, self.vocab_size):
            raise InvalidConstraintError(
                f"{spec.field_name} accepts no string (no token can start one: a rule such as `root ::= root root` "
                "never ends); give a grammar that some text satisfies.", spec.field_name,
            )
        return compiled


def _accepts_a_first_token(compiled: xgr.CompiledGrammar, vocab_size: int) -> bool:
    """Whether any token may start the output (or the empty output is complete): a grammar
    whose language is empty would otherwise be sampled from a row with every token masked."""
    matcher = xgr.GrammarMatcher(compiled)
    if matcher.is_terminated():
        return True
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())
