"""Reasoning parsers on their own: the split of a thinking model's text into reasoning and content,
the same however the text arrives in pieces (a tag cut anywhere), where a prompt leaves the
output (thinking, answering, or as the format has it), the reasoning tokens counted from the ids
(or from the text when the tags were tokenized otherwise), and the grammar held back by phase."""

from __future__ import annotations

import copy
import itertools

import pytest

from pagedllm.entrypoints.openai.reasoning import (
    AUTO,
    REASONING_FORMATS,
    REASONING_PARSERS,
    Phase,
    ReasoningParser,
    ReasoningSplitter,
    auto_parser_name,
)
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

QWEN3 = REASONING_FORMATS["qwen3"]
DEEPSEEK = REASONING_FORMATS["deepseek_r1"]


def split_in_pieces(fmt, phase: Phase, pieces: list[str]) -> tuple[str, str]:
    """(reasoning, content) of `pieces` fed one by one, the last as the final one."""
    splitter = ReasoningSplitter(fmt, phase)
    reasoning, content = "", ""
    for i, piece in enumerate(pieces):
        r, c = splitter.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


def every_split(text: str):
    """The text whole, char by char, and cut at every pair of places."""
    yield [text]
    yield list(text) + [""]
    for i, j in itertools.combinations(range(len(text) + 1), 2):
        yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize("fmt, phase, text, reasoning, content", [
    (QWEN3, Phase.BEFORE, "<think>plan</think>answer", "plan", "answer"),
    (QWEN3, Phase.BEFORE, "Sure. <think>plan</think> answer", "plan", "Sure.  answer"),  # text before <think>
    (QWEN3, Phase.BEFORE, "no tags </think> at all", "", "no tags </think> at all"),
    (QWEN3, Phase.BEFORE, "<think>cut short by max_tok", "cut short by max_tok", ""),
    (QWEN3, Phase.BEFORE, "a < b </thin <think>x <</think>y</think>", "x <", "a < b </thin y</think>"),
    (QWEN3, Phase.ANSWER, "<think>plan</think>answer", "", "<think>plan</think>answer"),  # the prompt closed it
    (DEEPSEEK, Phase.THINKING, "plan</think>answer", "plan", "answer"),  # open from the prompt
    (DEEPSEEK, Phase.THINKING, "\n<think>\nplan</think>\n\nanswer", "\nplan", "\n\nanswer"),  # the tag rewritten
    (DEEPSEEK, Phase.THINKING, "no end tag before max_tokens", "no end tag before max_tokens", ""),
    (DEEPSEEK, Phase.THINKING, "a <think> inside</think>b", "a <think> inside", "b"),
    (DEEPSEEK, Phase.THINKING, "plan</think></think>", "plan", "</think>"),
    (REASONING_FORMATS["mistral"], Phase.BEFORE, "[THINK]plan[/THINK]answer", "plan", "answer"),
])
def test_the_split_is_the_same_however_the_text_is_cut(fmt, phase, text, reasoning, content):
    for pieces in every_split(text):
        assert split_in_pieces(fmt, phase, pieces) == (reasoning, content), pieces


def test_a_tag_cut_across_deltas_is_held_until_it_is_whole_and_never_leaks():
    splitter = ReasoningSplitter(QWEN3, Phase.BEFORE)
    assert splitter.feed("hi <th") == ("", "hi ")  # "<th" may begin <think>
    assert splitter.feed("ink>pl") == ("pl", "")
    assert splitter.feed("an</") == ("an", "")  # "</" may begin </think>
    assert splitter.feed("thi") == ("", "")
    assert splitter.feed("nk>ans") == ("", "ans")
    assert splitter.reasoning_ended
    assert splitter.feed("wer</think>", final=True) == ("", "wer</think>")  # once answering, tags are text


def test_held_text_that_is_no_tag_is_released_with_what_follows_or_at_the_end():
    splitter = ReasoningSplitter(DEEPSEEK, Phase.THINKING)
    assert splitter.feed("a</thi") == ("a", "")
    assert splitter.feed("s is text") == ("</this is text", "")
    assert splitter.feed("</thi") == ("", "")
    assert splitter.feed("", final=True) == ("</thi", "")
    assert not splitter.reasoning_ended


def test_leading_whitespace_waits_to_see_whether_the_start_tag_follows():
    splitter = ReasoningSplitter(DEEPSEEK, Phase.THINKING)
    assert splitter.feed("\n") == ("", "")
    assert splitter.feed("plan") == ("\nplan", "")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    """The served models' tokenizer (its tags are several tokens each)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="module")
def thinking_tokenizer(tokenizer):
    """The served tokenizer with <think> and </think> as tokens of their own (as reasoning models have them)."""
    extended = copy.deepcopy(tokenizer)
    extended.add_tokens(["<think>", "</think>"])
    return extended


def prompt_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" + text, add_special_tokens=False)


@pytest.mark.parametrize("name, prompt_end, phase", [
    ("qwen3", "", Phase.BEFORE),
    ("qwen3", "<think>\n", Phase.THINKING),  # Qwen3.5 and R1-0528 templates open thinking in the prompt
    ("qwen3", "<think>\n\n</think>\n\n", Phase.ANSWER),  # enable_thinking false
    ("deepseek_r1", "", Phase.THINKING),
    ("deepseek_r1", "<think>", Phase.THINKING),
    ("deepseek_r1", "</think>", Phase.ANSWER),
    ("glm45", "<think></think>", Phase.ANSWER),
])
@pytest.mark.parametrize("tokens", ["one token per tag", "tags of several tokens"])
def test_the_prompts_last_tag_says_where_the_output_begins(tokenizer, thinking_tokenizer, name, prompt_end, phase, tokens):
    tok = thinking_tokenizer if tokens == "one token per tag" else tokenizer
    parser = ReasoningParser(name, tok)
    assert parser.for_prompt(prompt_ids(tok, prompt_end)).phase is phase
    # A tag earlier in the conversation (a past turn's thinking) settles nothing.
    history = tok.encode("<think>old</think>old answer<|im_end|>\n", add_special_tokens=False)
    assert parser.for_prompt(history + prompt_ids(tok, prompt_end)).phase is phase


@pytest.mark.parametrize("tokens", ["one token per tag", "tags of several tokens"])
def test_reasoning_tokens_are_counted_up_to_the_end_tag(tokenizer, thinking_tokenizer, tokens):
    tok = thinking_tokenizer if tokens == "one token per tag" else tokenizer
    parser = ReasoningParser("qwen3", tok)
    thinking = tok.encode("<think>a plan</think>", add_special_tokens=False)
    answer = tok.encode("the answer", add_special_tokens=False)
    before = parser.for_prompt(prompt_ids(tok, ""))
    assert before.num_reasoning_tokens(thinking + answer) == len(thinking)
    assert before.num_reasoning_tokens(thinking[:-1]) == len(thinking) - 1  # never ended: all of it
    assert before.num_reasoning_tokens(answer) == 0  # never thought
    assert parser.for_prompt(prompt_ids(tok, "<think>\n\n</think>\n\n")).num_reasoning_tokens(thinking + answer) == 0


def test_reasoning_tokens_are_found_from_the_text_when_the_tags_were_tokenized_otherwise(tokenizer):
    parser = ReasoningParser("deepseek_r1", tokenizer)
    # "</think>" as "<", "/", "think>" pieces rather than the tokenizer's own "</", "think", ">".
    odd_end = [tokenizer.convert_tokens_to_ids(t) for t in ("<", "/", "think", ">")]
    assert tokenizer.decode(odd_end) == "</think>" and odd_end != parser.end_token_ids
    plan = tokenizer.encode("a plan", add_special_tokens=False)
    answer = tokenizer.encode(" answer", add_special_tokens=False)
    thinking = parser.for_prompt(prompt_ids(tokenizer, "<think>\n"))
    assert thinking.num_reasoning_tokens(plan + odd_end + answer) == len(plan) + len(odd_end)


def test_the_grammar_waits_for_the_end_tag_and_the_first_token_may_open_thinking(tokenizer, thinking_tokenizer):
    def constrained(tok, prompt_end: str) -> StructuredOutputsParams:
        params = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}, field_name="response_format"))
        ReasoningParser("qwen3", tok).for_prompt(prompt_ids(tok, prompt_end)).constrain(params)
        return params.structured_outputs

    think, end = thinking_tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    opened = constrained(thinking_tokenizer, "<think>\n")
    assert (opened.reasoning_end_token_ids, opened.reasoning_start_token_id) == ([end], None)
    assert opened.field_name == "response_format" and opened.json == {"type": "object"}
    optional = constrained(thinking_tokenizer, "")
    assert (optional.reasoning_end_token_ids, optional.reasoning_start_token_id) == ([end], think)
    closed = constrained(thinking_tokenizer, "<think>\n\n</think>\n\n")
    assert closed.reasoning_end_token_ids is None  # the grammar applies from the first token
    # A start tag of several tokens cannot be offered beside the grammar's first tokens: a prompt
    # that does not open thinking gets the grammar at once; one that opens it, after the end tag.
    assert constrained(tokenizer, "").reasoning_end_token_ids is None
    assert constrained(tokenizer, "<think>\n").reasoning_end_token_ids == tokenizer.encode("</think>", add_special_tokens=False)


def test_a_request_without_a_grammar_is_left_alone(tokenizer):
    params = SamplingParams()
    ReasoningParser("deepseek_r1", tokenizer).for_prompt(prompt_ids(tokenizer, "")).constrain(params)
    assert params.structured_outputs is None


def test_llama_servers_auto_format_picks_the_parser_the_template_calls_for(tokenizer):
    assert auto_parser_name("{{ '[THINK]' }}{{ messages }}") == "mistral"
    assert auto_parser_name("{{ '<think>\\n' }}") == auto_parser_name(None) == "qwen3"
    assert ReasoningParser.for_server(AUTO, tokenizer).name == "qwen3"
    assert ReasoningParser.for_server(None, tokenizer) is None


def test_an_unknown_parser_is_refused_with_the_names(tokenizer):
    with pytest.raises(ValueError) as refused:
        ReasoningParser("deepseek", tokenizer)
    assert all(name in str(refused.value) for name in REASONING_PARSERS)
