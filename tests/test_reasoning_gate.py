"""The engine's side of reasoning parsers: a grammar held back while the model thinks. Until the
output holds the end tag's token ids the grammar masks nothing and sees no token; from the token
after, it is the grammar of a fresh request; a format whose thinking is optional lets the first
token open it. Without a gate a constraint is exactly xgrammar's (as before the gate existed)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

VOCAB = 49152
SPEC = StructuredOutputsParams(choice=["yes", "no"])


@pytest.fixture(scope="module")
def tokenizer():
    from pagedllm.transformers_utils import get_tokenizer, resolve_model

    return get_tokenizer(resolve_model(None))


@pytest.fixture(scope="module")
def compiled(tokenizer):
    from pagedllm.structured import GrammarCompiler

    return GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id]).compile(SPEC)


def allowed(constraint) -> torch.Tensor:
    from pagedllm.sampling.controls import unpack_bitmask
    from pagedllm.structured.constraint import num_words

    bitmask = torch.full((1, num_words(VOCAB)), -1, dtype=torch.int32)
    constraint.fill(bitmask, 0)
    return unpack_bitmask(bitmask, VOCAB)[0]


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_without_a_gate_the_mask_is_xgrammars_own(compiled, tokenizer):
    import xgrammar as xgr

    from pagedllm.structured import SequenceConstraint

    constraint = SequenceConstraint.create(compiled, VOCAB)
    matcher = xgr.GrammarMatcher(compiled)
    for token in [None, *ids(tokenizer, "yes")]:
        if token is not None:
            assert constraint.accept_token(token) and matcher.accept_token(token)
        expected = xgr.allocate_token_bitmask(1, VOCAB)
        matcher.fill_next_token_bitmask(expected, 0)
        mine = torch.full_like(expected, -1)
        constraint.fill(mine, 0)
        assert torch.equal(mine, expected)


def test_the_grammar_starts_fresh_after_a_multi_token_end_tag(compiled, tokenizer):
    from pagedllm.structured import ReasoningGate, SequenceConstraint

    end = ids(tokenizer, "</think>")
    assert len(end) > 1
    gated = SequenceConstraint.create(compiled, VOCAB, gate=ReasoningGate(end))
    fresh = SequenceConstraint.create(compiled, VOCAB)
    thinking = ids(tokenizer, "a plan, not yes or no </thin") + end[:-1] + ids(tokenizer, "x")  # a near miss
    for token in thinking:
        assert allowed(gated).all()  # the thinking is free
        assert gated.accept_token(token)  # and the grammar never sees it
    fork = gated.fork()
    for token in end:
        assert allowed(gated).all()
        gated.accept_token(token)
    assert torch.equal(allowed(gated), allowed(fresh))  # the grammar from its initial state
    assert allowed(fork).all()  # a fork taken while thinking thinks on
    for token in ids(tokenizer, "no"):
        assert gated.accept_token(token) and fresh.accept_token(token)
        assert torch.equal(allowed(gated), allowed(fresh))
    assert not gated.accept_token(ids(tokenizer, "x")[0])  # the answer is constrained


def test_optional_thinking_may_be_opened_by_the_first_token_only(compiled, tokenizer):
    from pagedllm.structured import ReasoningGate, SequenceConstraint

    think, end = 31, ids(tokenizer, "</think>")  # any token id will do as the start tag here

    def gated():
        return SequenceConstraint.create(compiled, VOCAB, gate=ReasoningGate(end, start_token_id=think))

    fresh = SequenceConstraint.create(compiled, VOCAB)
    first = allowed(gated())
    expected = allowed(fresh)
    assert first[think] and not expected[think]
    first[think] = False
    assert torch.equal(first, expected)  # the grammar's first tokens, and the start tag

    opened = gated()
    opened.accept_token(think)
    assert allowed(opened).all()  # thinking: free until the end tag
    opened.accept_token(think)  # the start token later is just a thinking token
    for token in end:
        opened.accept_token(token)
    assert torch.equal(allowed(opened), expected)

    answered = gated()
    yes = ids(tokenizer, "yes")
    assert answered.accept_token(yes[0]) and fresh.accept_token(yes[0])  # the grammar took the first token
    assert torch.equal(allowed(answered), allowed(fresh))


def test_reasoning_token_ids_are_checked_where_they_are_given(tokenizer):
    from pagedllm.engine.constraints import RequestConstraints

    with pytest.raises(ValueError, match="reasoning_end_token_ids must be a non-empty list"):
        StructuredOutputsParams(choice=["a"], reasoning_end_token_ids=[])
    with pytest.raises(ValueError, match="given with reasoning_end_token_ids"):
        StructuredOutputsParams(choice=["a"], reasoning_start_token_id=3)
    constraints = RequestConstraints(tokenizer, VOCAB, [tokenizer.eos_token_id])
    too_far = StructuredOutputsParams(choice=["a"], reasoning_end_token_ids=[VOCAB], field_name="response_format")
    with pytest.raises(ValueError, match=r"response_format's reasoning token ids are outside the vocabulary"):
        constraints.check(SamplingParams(structured_outputs=too_far))
