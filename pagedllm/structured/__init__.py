"""Structured outputs and token constraints on xgrammar: grammars compiled from a request's spec,
and each step's bitmask of the tokens a constrained sequence may draw next.

Imports torch and xgrammar, so the engine loads it only when a request first needs it."""

from pagedllm.structured.compiler import GrammarCompiler, InvalidConstraintError
from pagedllm.structured.constraint import SequenceConstraint, fill_step_bitmasks, pack_token_ids

__all__ = ["GrammarCompiler", "InvalidConstraintError", "SequenceConstraint", "fill_step_bitmasks", "pack_token_ids"]
