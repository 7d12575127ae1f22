"""Structured outputs and token controls inside the engine, on a tiny random model: on random
weights a constrained output must still satisfy its grammar, through parallel samples, beams,
swap and recompute preemption; stop strings and max_tokens still end it; a grammar still
compiling holds back only its own request; allowed_token_ids, logit_bias and bad_words hold."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from tests.helpers import random_prompts

# Finite languages: whatever a random model prefers, every output ends within a few tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "level": {"type": "integer", "minimum": 0, "maximum": 9},
        "kind": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
    },
    "required": ["level", "kind", "ok"],
}
JSON = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
REGEX = r"[a-c]{3}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe later"]
GRAMMAR = 'root ::= "(" digit ("+" digit)? ")"\ndigit ::= [0-9]'
GRAMMAR_TEXT = re.compile(r"\([0-9](\+[0-9])?\)")


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), max_model_len=256, num_gpu_blocks=256)


def assert_valid_json(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def test_each_kind_of_constraint_holds_under_sampling_with_parallel_samples(llm):
    prompts = random_prompts(4, [7, 12, 5, 9], seed=1)
    params = [
        SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=40, structured_outputs=JSON),
        SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=REGEX)),
        SamplingParams(n=2, best_of=3, temperature=1.0, seed=3, max_tokens=40,
                       structured_outputs=StructuredOutputsParams(choice=CHOICES)),
        SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=40, structured_outputs=StructuredOutputsParams(grammar=GRAMMAR)),
    ]
    json_out, regex_out, choice_out, grammar_out = llm.generate(prompts, params, use_tqdm=False)
    for choice in json_out.outputs:
        assert_valid_json(choice.text)
        assert choice.finish_reason == "stop"
    assert all(re.fullmatch(REGEX, c.text) for c in regex_out.outputs)
    assert len(choice_out.outputs) == 2 and all(c.text in CHOICES for c in choice_out.outputs)
    assert all(GRAMMAR_TEXT.fullmatch(c.text) for c in grammar_out.outputs)


def test_beam_search_keeps_every_beam_inside_the_grammar(llm):
    params = SamplingParams(use_beam_search=True, n=3, best_of=3, temperature=0, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    (out,) = llm.generate([random_prompts(1, [6], seed=2)[0]], params, use_tqdm=False)
    assert len(out.outputs) == 3
    assert all(c.text in CHOICES for c in out.outputs)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_the_grammar_state_survives_preemption(tiny_llama, mode):
    llm = LLM(str(tiny_llama), max_model_len=64, num_gpu_blocks=8, swap_space=0.01, preemption_mode=mode, max_num_seqs=8)
    prompts = random_prompts(4, [20, 27, 22, 18], seed=5)
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=30, structured_outputs=JSON)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    assert (stats.num_swap_preemptions > 0) == (mode == "swap")
    for out in outputs:
        for choice in out.outputs:
            assert_valid_json(choice.text)


def test_a_stop_string_or_max_tokens_ends_a_constrained_output_early(llm):
    prompt = random_prompts(1, [8], seed=3)[0]
    regex = StructuredOutputsParams(regex=r"(ab|cd){20}")
    (full,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, structured_outputs=regex), use_tqdm=False)
    assert re.fullmatch(r"(ab|cd){20}", full.outputs[0].text)
    stop = full.outputs[0].text[4:8]
    (cut,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60, stop=[stop], structured_outputs=regex), use_tqdm=False)
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert cut.outputs[0].text == full.outputs[0].text[: full.outputs[0].text.index(stop)]
    (short,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, structured_outputs=regex), use_tqdm=False)
    assert short.outputs[0].finish_reason == "length" and len(short.outputs[0].token_ids) == 3


def test_a_compiling_grammar_holds_back_only_its_own_request(llm, monkeypatch):
    engine = llm.llm_engine
    compiled = engine.constraints.compile(JSON).result()
    slow: Future = Future()
    monkeypatch.setattr(engine.constraints, "compile", lambda spec, pin=False: slow)
    prompt = random_prompts(1, [5], seed=4)[0]
    engine.add_request("constrained", prompt, SamplingParams(temperature=0, max_tokens=30, structured_outputs=JSON))
    engine.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    finished = {}
    for _ in range(20):
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "free" in finished and "constrained" not in finished  # the batch ran without it
    slow.set_result(compiled)
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert_valid_json(finished["constrained"].outputs[0].text)


@pytest.mark.parametrize(
    "spec, param",
    [
        (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nope"}}}), "structured_outputs.json"),
        (StructuredOutputsParams(regex="[a-"), "structured_outputs.regex"),
        (StructuredOutputsParams(grammar="root ::= missing"), "structured_outputs.grammar"),
        (StructuredOutputsParams(json="{not json"), "structured_outputs.json"),
        # Languages with no finite string: strings that start but never end.
        (StructuredOutputsParams(grammar='root ::= r\nr ::= "y" r'), "structured_outputs.grammar"),
        (StructuredOutputsParams(json={"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}),
         "structured_outputs.json"),
        # Keywords xgrammar accepts and ignores (outputs could break them): refused, as vLLM does.
        (StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}), "structured_outputs.json"),
        (StructuredOutputsParams(json={"properties": {"if": {"not": {"type": "string"}}}}), "structured_outputs.json"),
        (StructuredOutputsParams(json={"allOf": [{"type": "string"}, {"minLength": 3}]}), "structured_outputs.json"),
    ],
)
def test_an_invalid_spec_is_refused_naming_its_field_and_the_engine_goes_on(llm, spec, param):
    with pytest.raises(ValueError) as error:
        llm.generate([[5, 6, 7]], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert error.value.param == param
    assert not llm.llm_engine.has_unfinished_requests()
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_a_schema_keyword_xgrammar_ignores_is_named_with_its_place(llm):
    """xgrammar lets through values that `not`, `uniqueItems`, `if` or an `allOf` of two schemas
    forbid; the refusal names the keyword and where it is, and a property merely named so is fine."""
    schema = {"type": "object", "properties": {"if": {"type": "string"}, "tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(ValueError, match=r"^The JSON schema in structured_outputs.json uses 'uniqueItems' at \$\.properties\.tags.*does not enforce"):
        llm.llm_engine.constraints.wait_compiled(StructuredOutputsParams(json=schema))
    del schema["properties"]["tags"]["uniqueItems"]
    assert llm.llm_engine.constraints.wait_compiled(StructuredOutputsParams(json=schema)) is not None


def test_allowed_token_ids_hold_under_sampling(llm):
    allowed = [11, 222, 3333, 44444]
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(n=4, temperature=1.5, seed=0, max_tokens=20, ignore_eos=True,
                                                      allowed_token_ids=allowed), use_tqdm=False)
    assert all(set(c.token_ids) <= set(allowed) for c in out.outputs)


def test_logit_bias_minus_100_removes_a_token_and_plus_100_forces_one(llm):
    prompt = [9, 8, 7]
    (plain,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    banned = plain.outputs[0].token_ids[0]
    (without,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                       logit_bias={banned: -100}), use_tqdm=False)
    assert banned not in without.outputs[0].token_ids
    (forced,) = llm.generate([prompt], SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True,
                                                      logit_bias={777: 1000}), use_tqdm=False)
    assert forced.outputs[0].token_ids == [777] * 6  # 1000 is clamped to 100, which still dominates


def test_bad_words_never_appear(llm):
    prompt = [4, 5, 6]
    (plain,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    word = tokenizer.decode(plain.outputs[0].token_ids[:1]).strip()
    assert word
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word]),
                          use_tqdm=False)
    banned = {tuple(tokenizer.encode(t, add_special_tokens=False)) for t in (word, " " + word)}
    ids = out.outputs[0].token_ids
    assert not any(tuple(ids[i : i + len(b)]) == b for b in banned for i in range(len(ids)))


def test_a_multi_token_bad_word_bans_its_last_token_only_after_its_prefix():
    from pagedllm.sampling.controls import unpack_bitmask
    from pagedllm.structured import SequenceConstraint

    vocab = 100
    constraint = SequenceConstraint.create(None, vocab, bad_words=[[5, 63], [31]])

    def allowed() -> torch.Tensor:
        bitmask = torch.full((1, 4), -1, dtype=torch.int32)
        constraint.fill(bitmask, 0)
        return unpack_bitmask(bitmask, vocab)[0]

    assert not allowed()[31] and allowed()[63]  # a one-token bad word: always banned
    constraint.accept_token(5)
    fork = constraint.fork()
    assert not allowed()[63] and allowed()[62] and allowed()[64]
    constraint.accept_token(6)
    assert allowed()[63]
    fork_mask = torch.full((1, 4), -1, dtype=torch.int32)
    fork.fill(fork_mask, 0)
    assert not unpack_bitmask(fork_mask, vocab)[0][63]  # the fork kept the state it was forked with


def test_the_packed_bitmask_matches_xgrammar_layout():
    import xgrammar as xgr

    from pagedllm.sampling.controls import unpack_bitmask
    from pagedllm.structured import pack_token_ids

    ids = [0, 31, 32, 63, 64, 95, 99]
    packed = pack_token_ids(ids, 100)
    logits = torch.zeros(1, 100)
    xgr.apply_token_bitmask_inplace(logits, packed.unsqueeze(0))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == ids
    assert unpack_bitmask(packed.unsqueeze(0), 100)[0].nonzero().flatten().tolist() == ids


def test_prefix_caching_is_unaffected_by_a_constraint(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=256, num_gpu_blocks=64, enable_prefix_caching=True)
    prompt = random_prompts(1, [40], seed=9)[0]
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=JSON)
    (first,) = llm.generate([prompt], params, use_tqdm=False)
    (second,) = llm.generate([prompt], params, use_tqdm=False)
    assert second.num_cached_tokens >= 32  # two full blocks of the prompt came from the cache
    assert second.outputs[0].text == first.outputs[0].text
    assert_valid_json(second.outputs[0].text)


@pytest.mark.slow
def test_constraints_hold_with_tensor_parallelism(tiny_llama):
    """The driver computes the bitmasks beside the scheduler; they travel in the control message
    to every rank, and the driver's sampler applies them."""
    llm = LLM(str(tiny_llama), max_model_len=256, num_gpu_blocks=64, tensor_parallel_size=2)
    regex, allowed = StructuredOutputsParams(regex=REGEX), [11, 22]
    sampled, greedy = llm.generate(
        [[5, 6, 7], [8, 9]],
        [SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=20, structured_outputs=regex),
         SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed)],
        use_tqdm=False,
    )
    llm.llm_engine.shutdown()
    assert all(re.fullmatch(REGEX, c.text) for c in sampled.outputs)
    assert set(greedy.outputs[0].token_ids) <= set(allowed)


def test_reported_logprobs_stay_those_of_the_raw_model_under_a_mask(llm):
    prompt = [3, 1, 4, 1, 5]
    (plain,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=1), use_tqdm=False)
    best = plain.outputs[0].token_ids[0]
    allowed = [t for t in (1000, 2000) if t != best]
    (masked,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=1, allowed_token_ids=allowed),
                             use_tqdm=False)
    chosen = masked.outputs[0].token_ids[0]
    position = masked.outputs[0].logprobs[0]
    assert chosen in allowed
    # The model's own favourite is still reported first, with its unmasked log-probability.
    assert position[best].rank == 1
    assert position[best].logprob == pytest.approx(plain.outputs[0].logprobs[0][best].logprob, abs=1e-5)
    assert position[chosen].logprob < position[best].logprob


def test_without_xgrammar_loaded_the_mask_is_applied_the_same_in_torch(monkeypatch):
    import sys
    from types import SimpleNamespace

    import xgrammar  # noqa: F401  (loaded: the first application uses its kernel)

    from pagedllm.sampling.controls import apply_token_controls
    from pagedllm.structured import pack_token_ids

    vocab, gen = 100, torch.Generator().manual_seed(5)
    allowed = [sorted(torch.randperm(vocab, generator=gen)[:k].tolist()) for k in (3, 40)]
    items = [SimpleNamespace(token_bitmask=None, sampling_params=SamplingParams())]
    items += [SimpleNamespace(token_bitmask=pack_token_ids(ids, vocab), sampling_params=SamplingParams()) for ids in allowed]
    logits = torch.randn(3, vocab, generator=gen)
    with_kernel = logits.clone()
    apply_token_controls(with_kernel, items)
    monkeypatch.delitem(sys.modules, "xgrammar")
    in_torch = logits.clone()
    apply_token_controls(in_torch, items)
    assert torch.equal(in_torch, with_kernel)
    assert torch.equal(in_torch[0], logits[0])
    assert torch.isfinite(in_torch[1]).nonzero().flatten().tolist() == allowed[0]


def test_allowed_token_ids_and_bad_words_never_import_xgrammar(tiny_llama):
    """xgrammar takes seconds to import: a request without a grammar must not make the engine's
    thread wait for it (a fresh process, since this one may have loaded it)."""
    import subprocess
    import sys

    script = f"""
import sys
from pagedllm import LLM, SamplingParams
llm = LLM({str(tiny_llama)!r}, device="cpu", dtype="float32", max_model_len=64, num_gpu_blocks=16)
out = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, max_tokens=8, seed=1, allowed_token_ids=[11, 12, 13],
                   bad_words=["hello"]), use_tqdm=False)
assert set(out[0].outputs[0].token_ids) <= {{11, 12, 13}}, out[0].outputs[0].token_ids
assert "xgrammar" not in sys.modules
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_thousands_of_bad_words_are_prepared_once_and_all_hold(llm):
    """The words are tokenized on the token thread into a mask and a prefix table; every one of
    them, one-token or longer, stays out of the output."""
    prompt = [4, 5, 6]
    tokenizer = llm.get_tokenizer()
    (plain,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    seen = tokenizer.decode(plain.outputs[0].token_ids)
    words = [w for w in seen.split() if w.strip()][:3] + [f"filler{i}word" for i in range(3000)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=words)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    controls = llm.llm_engine.constraints.prepare_controls(params).result()
    assert sum(len(t) for t in controls.by_prefix.values()) > 1000  # the long words went into the table
    ids = out.outputs[0].token_ids
    for word in words[:3]:
        for text in (word, " " + word):
            banned = tuple(tokenizer.encode(text, add_special_tokens=False))
            assert not any(tuple(ids[i : i + len(banned)]) == banned for i in range(len(ids)))
