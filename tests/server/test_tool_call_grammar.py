"""The grammar that keeps "auto" calls well-formed (`tool_parsers.call_grammar`), alone with
xgrammar and the test tokenizer: a model that writes any text, opens a call and then strays
(any characters, an unknown name, broken JSON) is masked, token by token, into a call of a
declared tool whose arguments fit its schema; the parser never sees a malformed call in any
prefix, and a call the grammar closed is always parsed as a call."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.entrypoints.openai.tools import tool_functions

xgr = pytest.importorskip("xgrammar")

TOOLS = tool_functions([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2]}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"],
        "additionalProperties": False}}},
])
# The constrained formats: (the call-opening text, the text that closes a call).
CONSTRAINED = {"hermes": ("<tool_call>", "</tool_call>"), "phi4_mini_json": ("functools[", "}]"),
               "qwen3_xml": ("<tool_call>", "</tool_call>"), "qwen3_coder": ("<tool_call>", "</tool_call>"),
               "llama3_json": ("<|python_tag|>", "}"), "mistral": ("[TOOL_CALLS]", "]"), "pythonic": ("<|python_start|>", "]")}
CONSTRAINED |= {"llama4_json": CONSTRAINED["llama3_json"], "llama4_pythonic": CONSTRAINED["pythonic"]}  # vLLM's aliases
# The formats whose calls are also the whole answer when it opens so: a model's first words.
LEADING = {"llama3_json": '{"name": "get_time", "parameters": {"zone": ', "mistral": '[{"name": "get_weather", "arguments": {"city": ',
           "pythonic": '[get_weather(city="Paris", days='}
LEADING |= {"llama4_json": LEADING["llama3_json"], "llama4_pythonic": LEADING["pythonic"]}
MAX_STEPS = 60


@pytest.fixture(scope="module")
def vocabulary(tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    compiled = {name: compiler.compile_grammar(TOOL_PARSERS[name](TOOLS).call_grammar()) for name in CONSTRAINED}
    blank = torch.tensor([i for i in range(len(tokenizer)) if not tokenizer.decode([i]).strip()])
    return tokenizer, compiled, blank


def allowed_ids(matcher, vocab_size: int) -> torch.Tensor:
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    bits = (bitmask[0].to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1
    return bits.flatten()[:vocab_size].nonzero().flatten()


def masked_walk(tokenizer, compiled, intended: str, picks: list[int], blank: torch.Tensor) -> tuple[list[int], bool]:
    """The tokens of `intended` as far as the grammar allows each; a token it refuses (and every
    token once `intended` runs out) replaced by an allowed one, chosen by `picks`, not a `blank`
    (whitespace) one where another is allowed (a model does not write whitespace forever). Stops
    when the grammar ends or after MAX_STEPS: (the token ids, whether the grammar ended)."""
    matcher = xgr.GrammarMatcher(compiled)
    wanted = tokenizer.encode(intended, add_special_tokens=False)
    output: list[int] = []
    for step in range(MAX_STEPS):
        if matcher.is_terminated():
            return output, True
        token = wanted[step] if step < len(wanted) else None
        if token is None or not matcher.accept_token(token):
            allowed = allowed_ids(matcher, len(tokenizer))
            allowed = allowed[allowed != tokenizer.eos_token_id]  # a model that goes on writing
            if not len(allowed):
                return output, True  # the grammar allows only the end
            written = allowed[~torch.isin(allowed, blank)]
            allowed = written if len(written) else allowed
            token = int(allowed[picks[step % len(picks)] % len(allowed)])
            assert matcher.accept_token(token)
        output.append(token)
    return output, False


def test_each_constrained_format_has_a_grammar_and_the_others_none():
    for name, parser in TOOL_PARSERS.items():
        assert (parser(TOOLS).call_grammar() is not None) == (name in CONSTRAINED)
    assert TOOL_PARSERS["hermes"]().tools is None  # no declared tools: nothing to constrain to


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(CONSTRAINED)),
       content=st.text(alphabet="ab {}<>\"", max_size=8),
       stray=st.text(alphabet='abxyz_ {}[]":,0129\n<>/=', max_size=30),
       opening=st.sampled_from(["", '{"name": "launch", "arguments": {', '{"name": "get_weather", "arguments": {"city": "Rome"',
                                '\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>', '{"name": "get_time", "arguments": {"zone": "UTC"}}]',
                                "\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n",
                                "\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>"]),
       picks=st.lists(st.integers(0, 2**31), min_size=1, max_size=20),
       leading=st.booleans())
def test_no_constrained_auto_call_is_ever_malformed(vocabulary, name, content, stray, opening, picks, leading):
    tokenizer, compiled, blank = vocabulary
    trigger, close = CONSTRAINED[name]
    parser = TOOL_PARSERS[name](TOOLS)
    if leading and name in LEADING:  # the calls are the answer: no content, no tag
        content, trigger, opening = "", "", LEADING[name]
    token_ids, ended = masked_walk(tokenizer, compiled[name], content + trigger + opening + stray, picks, blank)
    for end in range(len(token_ids) + 1):  # what a stream sees, token by token
        prefix = tokenizer.decode(token_ids[:end])
        assert not parser.scan(prefix, final=False).failed, prefix
    text = tokenizer.decode(token_ids)
    opened = text.find(trigger) if trigger else len(text) - len(text.lstrip())
    _, calls = parser.extract(text)
    # The grammar closed the first call (these formats' text goes on free after it), or closed
    # them all (those of LEADING end the answer with their calls: one cut short is no call).
    closed = ended if name in LEADING else close in text[opened + len(trigger):]
    if opened != -1 and closed:
        assert calls, text
    for call in calls:
        assert call.name in TOOLS
        jsonschema.validate(json.loads(call.arguments), TOOLS[call.name]["parameters"])


def test_a_model_that_strays_inside_a_call_is_masked_into_a_declared_tools_call(vocabulary):
    tokenizer, compiled, blank = vocabulary
    intended = 'Let me see. <tool_call>\n{"name": "launch_missiles", "arguments": {"target": "moon"}}\n</tool_call>'
    token_ids, _ = masked_walk(tokenizer, compiled["hermes"], intended, [0], blank)
    content, calls = TOOL_PARSERS["hermes"](TOOLS).extract(tokenizer.decode(token_ids))
    assert content == "Let me see."
    assert [c.name for c in calls][:1] in (["get_weather"], ["get_time"])
    jsonschema.validate(json.loads(calls[0].arguments), TOOLS[calls[0].name]["parameters"])


def test_auto_requests_get_the_grammar_unless_they_constrain_their_output_already():
    from pagedllm.entrypoints.openai.tool_parsers.call_grammar import constrain_auto_calls
    from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

    params = SamplingParams()
    asyncio.run(constrain_auto_calls(params, TOOL_PARSERS["hermes"](TOOLS)))
    assert params.structured_outputs.grammar == TOOL_PARSERS["hermes"](TOOLS).call_grammar()
    own = StructuredOutputsParams(json={"type": "object"})
    params = SamplingParams(structured_outputs=own)
    asyncio.run(constrain_auto_calls(params, TOOL_PARSERS["hermes"](TOOLS)))
    assert params.structured_outputs is own
    params = SamplingParams()
    asyncio.run(constrain_auto_calls(params, TOOL_PARSERS["mistral"]()))  # no declared tools: nothing to constrain to
    assert params.structured_outputs is None


def test_pythonic_keywords_are_the_required_then_any_optional_in_order_and_the_grammar_grows_linearly(vocabulary):
    """Optional keywords may each be left out (the first one given has no comma before it); the
    grammar shares its rules between those choices, so its size grows with the properties, not
    with the ways to pick among them (it was quadratic: 7 s to build for 100 optional ones)."""
    tokenizer, _, _ = vocabulary
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1)

    def tools(required: list[str], optional: list[str]) -> dict:
        properties = {key: {"type": "integer"} for key in required + optional}
        return tool_functions([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": properties, "required": required}}}])

    def accepts(grammar: str, text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
        return matcher.accept_string(text) and matcher.accept_token(tokenizer.eos_token_id)

    optional_only = TOOL_PARSERS["pythonic"](tools([], ["a", "b", "c"])).call_grammar()
    for text in ("[f()]", "[f(b=2)]", "[f(a=1, c=3)]", "[f(a=1, b=2, c=3)]"):
        assert accepts(optional_only, text), text
    for text in ("[f(, b=2)]", "[f(b=2, a=1)]", "[f(a=1,)]", "[f(d=1)]"):
        assert not accepts(optional_only, text), text
    mixed = TOOL_PARSERS["pythonic"](tools(["x"], ["a"])).call_grammar()
    assert accepts(mixed, "[f(x=1)]") and accepts(mixed, "[f(x=1, a=2)]") and not accepts(mixed, "[f(a=2)]")
    sizes = [TOOL_PARSERS["pythonic"](tools([], [f"p{i}" for i in range(n)])).call_grammar().count("\n") for n in (50, 100)]
    assert sizes[1] < 2.2 * sizes[0]
