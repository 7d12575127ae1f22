"""Structured outputs and token constraints on xgrammar: grammars compiled from a request's spec,
and each step's bitmask of the tokens a constrained sequence may draw next.

Imports torch; xgrammar (about 5 s to import) only when a grammar is compiled or applied, so
that a request with only `allowed_token_ids` or `bad_words` never waits for it."""

from pagedllm.structured.constraint import (
    ReasoningGate,
    SequenceConstraint,
    TokenControls,
    fill_step_bitmasks,
    pack_token_ids,
)

__all__ = ["GrammarCompiler", "InvalidConstraintError", "ReasoningGate", "SequenceConstraint", "TokenControls", "fill_step_bitmasks", "pack_token_ids"]


def __getattr__(name: str):
    if name in ("GrammarCompiler", "InvalidConstraintError"):
        from pagedllm.structured import compiler

        return getattr(compiler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
