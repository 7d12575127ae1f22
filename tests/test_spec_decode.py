"""Speculative decoding: lossless (greedy token for token, sampling in distribution), with every
feature it meets in a batch, its configuration's errors, its counters, and how the controller
meets the engine's step budget (the controller alone: tests/engine/test_spec_controller.py).

Tiny random models rarely continue their prompt, so most tests use a model of 64 tokens (its
output repeats itself, and the n-gram proposer finds matches), and some replace the proposer with
an oracle that knows the plain engine's output and errs at chosen places, so acceptances and
rejections of every length happen."""

from __future__ import annotations

import collections

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs, SpeculativeConfig
from pagedllm.core import Sequence
from tests.helpers import hf_greedy, load_hf, random_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1, "adaptive": False}
SMALL_VOCAB = 64


@pytest.fixture(scope="module")
def small_vocab_model(tiny_models):
    return tiny_models("llama", vocab_size=SMALL_VOCAB)


def _prompts(count: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    return random_prompts(count, lengths, seed=seed, low=3, high=SMALL_VOCAB)


def _tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


class OracleProposer:
    """Proposes the plain engine's own continuation, wrong at every third proposal's second token."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        self.by_prompt = {tuple(p): o for p, o in zip(prompts, outputs)}
        self.calls = 0
        self.match_lengths: dict[int, int] = {}  # none stated: the controller's per-sequence rate

    def propose(self, seq: Sequence, k: int) -> list[int]:
        output = self.by_prompt[tuple(seq.prompt_token_ids)]
        proposal = list(output[seq.num_output_tokens : seq.num_output_tokens + k])
        self.calls += 1
        if self.calls % 3 == 0 and len(proposal) > 1:
            proposal[1] = (proposal[1] + 1) % SMALL_VOCAB
        return proposal

    def forget(self, live) -> None:
        pass


# --- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, field",
    [
        ({"method": "eagle"}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "ngram", "lookahead": 3}, "lookahead"),
        ({"method": "draft_model"}, "model"),
        ({"method": "ngram", "model": "x"}, "model"),
        ("{not json", "JSON"),
    ],
)
def test_bad_speculative_config_is_refused_naming_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(config)


def test_speculative_config_from_json_text_as_on_the_command_line():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}')
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max) == ("ngram", 3, 2)
    assert SpeculativeConfig.parse({"model": "/path"}).method == "draft_model"  # vLLM infers it


def test_a_reservation_policy_refuses_speculation_before_any_model_loads():
    with pytest.raises(ValueError, match="kv_policy='paged'"):
        EngineArgs(kv_policy="orca-max", speculative_config=NGRAM).create_engine_config()


def test_batch_invariant_mode_refuses_speculation():
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineArgs(batch_invariant=True, speculative_config=NGRAM).create_engine_config()


def test_speculative_config_flag_on_the_command_line():
    import argparse

    from pagedllm.entrypoints.cli_args import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']))
    assert args.create_engine_config().speculative.num_speculative_tokens == 2


# --- the engine's side of the controller -------------------------------------------------


def test_steps_that_verify_do_not_teach_the_step_time_budget(small_vocab_model, monkeypatch):
    """With adaptive speculation the steps that admit prompts verify nothing, so the budget's
    costs come from steps that verified nothing; without it every step teaches it."""
    prompt = _prompts(1, [12], seed=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for adaptive in (True, False):
        llm = LLM(str(small_vocab_model), max_model_len=128, num_gpu_blocks=64,
                  speculative_config={**NGRAM, "adaptive": adaptive})
        engine = llm.llm_engine
        taught = []
        monkeypatch.setattr(engine.step_budget, "observe", lambda seconds, tokens, logprob_tokens=0: taught.append(tokens))
        llm.generate(prompt, params, use_tqdm=False)
        stats = engine.get_stats()
        assert stats.spec_decode_num_drafts > 0  # one sequence: the steps that verified
        assert len(taught) == engine.num_steps - (stats.spec_decode_num_drafts if adaptive else 0)


# --- lossless: greedy ----------------------------------------------------------------------


def test_greedy_equals_plain_and_transformers_with_ngram_proposals(small_vocab_model):
    prompts = _prompts(4, [9, 17, 30])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kwargs = dict(max_model_len=256, num_gpu_blocks=512, int8_activations="off")  # compared with transformers
    plain = _tokens(LLM(str(small_vocab_model), **kwargs).generate(prompts, params, use_tqdm=False))
    llm = LLM(str(small_vocab_model), **kwargs, speculative_config=NGRAM)
    speculative = _tokens(llm.generate(prompts, params, use_tqdm=False))
    assert speculative == plain
    hf = load_hf(small_vocab_model)
    assert [o[0] for o in plain[:2]] == [hf_greedy(hf, p, 40, ignore_eos=True) for p in prompts[:2]]
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens  # rejections too


@pytest.fixture(scope="module")
def mixed_workload(small_vocab_model):
    """Greedy, seeded, parallel-sampling, beam and logprobs requests, prompts chunked (a budget of
    24 tokens a step), run without speculation once."""
    prompts = _prompts(8, [7, 40, 19, 33])
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    params = [greedy] * 4 + [
        SamplingParams(temperature=0.8, top_k=10, seed=7, max_tokens=30, ignore_eos=True),
        SamplingParams(n=3, temperature=1.0, top_k=10, seed=8, max_tokens=20, ignore_eos=True),
        SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2),
    ]
    kwargs = dict(max_model_len=256, max_num_batched_tokens=24, max_num_seqs=8, num_gpu_blocks=512)
    plain = LLM(str(small_vocab_model), **kwargs).generate(prompts, params, use_tqdm=False)
    return prompts, params, kwargs, plain


def test_mixed_batch_with_chunked_prompts_is_unchanged(small_vocab_model, mixed_workload):
    prompts, params, kwargs, plain = mixed_workload
    llm = LLM(str(small_vocab_model), **kwargs, speculative_config=NGRAM)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(outputs) == _tokens(plain)  # seeded samples too: the stream is rewound
    assert llm.llm_engine.get_stats().spec_decode_num_accepted_tokens > 0
    # Log-probabilities of accepted tokens are the target's, as without speculation.
    for mine, theirs in zip(outputs[-1].outputs[0].logprobs, plain[-1].outputs[0].logprobs):
        assert mine.keys() == theirs.keys()
        for token in mine:
            assert mine[token].logprob == pytest.approx(theirs[token].logprob, abs=1e-4)
            assert mine[token].rank == theirs[token].rank


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_is_unchanged_under_preemption(small_vocab_model, mode):
    prompts = _prompts(8, [20, 33, 9])
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = _tokens(LLM(str(small_vocab_model), max_model_len=128, num_gpu_blocks=512).generate(prompts, params, use_tqdm=False))
    llm = LLM(str(small_vocab_model), max_model_len=128, num_gpu_blocks=24, preemption_mode=mode, speculative_config=NGRAM)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == plain
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert (stats.num_swap_preemptions if mode == "swap" else stats.num_recompute_preemptions) > 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_oracle_proposals_are_verified_with_stops_and_max_tokens(small_vocab_model):
    """Long accepted runs: max_tokens is met exactly, and a stop token inside an accepted run
    ends the output there, as without speculation."""
    prompts = _prompts(3, [12, 25])
    params = SamplingParams(temperature=0, max_tokens=37, ignore_eos=True)
    plain = [o[0] for o in _tokens(LLM(str(small_vocab_model), max_model_len=256, num_gpu_blocks=512).generate(prompts, params, use_tqdm=False))]
    llm = LLM(str(small_vocab_model), max_model_len=256, num_gpu_blocks=512, speculative_config={**NGRAM, "num_speculative_tokens": 7})
    llm.llm_engine.speculator.proposer = OracleProposer(prompts, plain)
    assert [o[0] for o in _tokens(llm.generate(prompts, params, use_tqdm=False))] == plain
    per_pos = llm.llm_engine.get_stats().spec_decode_num_accepted_tokens_per_pos
    assert per_pos[0] >= per_pos[1] > 0 and per_pos[6] > 0  # full acceptances of 7 tokens
    stop = plain[0][20]
    stopped = SamplingParams(temperature=0, max_tokens=37, ignore_eos=True, stop_token_ids=[stop])
    expected = LLM(str(small_vocab_model), max_model_len=256, num_gpu_blocks=512).generate(prompts[:1], stopped, use_tqdm=False)[0].outputs[0]
    got = llm.generate(prompts[:1], stopped, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids and got.token_ids[-1] == stop and got.finish_reason == "stop"


def test_sliding_window_model_is_unchanged(tiny_models):
    """A window of 8 over blocks of 4: rollback and window freeing in the same tables."""
    model = tiny_models("mistral", vocab_size=SMALL_VOCAB, sliding_window=8)
    prompts = _prompts(3, [11, 26], seed=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kwargs = dict(max_model_len=256, block_size=4, num_gpu_blocks=512, int8_activations="off")  # compared with transformers
    plain = _tokens(LLM(str(model), **kwargs).generate(prompts, params, use_tqdm=False))
    llm = LLM(str(model), **kwargs, speculative_config=NGRAM)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == plain
    assert llm.llm_engine.get_stats().spec_decode_num_accepted_tokens > 0
    hf = load_hf(model)
    assert plain[0][0] == hf_greedy(hf, prompts[0], 40, ignore_eos=True)


# --- lossless: sampling --------------------------------------------------------------------


def _first_tokens(llm: LLM, prompt: list[int], num_samples: int) -> collections.Counter:
    """How often each sequence of the first three output tokens is drawn, over unseeded
    requests (the second step verifies a proposed token, which gives the third)."""
    params = SamplingParams(temperature=0.7, max_tokens=3, ignore_eos=True)
    outputs = llm.generate([prompt] * num_samples, params, use_tqdm=False)
    return collections.Counter(tuple(o.outputs[0].token_ids) for o in outputs)


def _chi_square_p(a: collections.Counter, b: collections.Counter, min_count: int = 10) -> float:
    """p-value of the chi-square test that two samples come from one distribution (categories
    with fewer than `min_count` draws in all are pooled)."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    rows, rest = [], [0, 0]
    for key in keys:
        if a[key] + b[key] >= min_count:
            rows.append((a[key], b[key]))
        else:
            rest[0] += a[key]
            rest[1] += b[key]
    if sum(rest) >= min_count:
        rows.append(tuple(rest))
    table = torch.tensor(rows, dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = (table.shape[0] - 1) * (table.shape[1] - 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


@pytest.fixture(scope="module")
def sampling_setup(small_vocab_model):
    """A prompt of the model's own greedy text (so n-gram proposals are sometimes right), the
    plain engine's draws of its first sampled tokens, and an engine verifying every proposal."""
    plain_llm = LLM(str(small_vocab_model), max_model_len=64, seed=1, num_gpu_blocks=2048)
    seed = [5, 9, 17]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = seed + plain_llm.generate([seed], greedy, use_tqdm=False)[0].outputs[0].token_ids
    plain = _first_tokens(plain_llm, prompt, NUM_SAMPLES)
    llm = LLM(str(small_vocab_model), max_model_len=64, seed=2, num_gpu_blocks=2048,
              speculative_config={**NGRAM, "num_speculative_tokens": 2, "prompt_lookup_min": 1})
    return prompt, plain, llm


NUM_SAMPLES = 4000


def test_sampled_distribution_is_unchanged(sampling_setup):
    prompt, plain, llm = sampling_setup
    before = llm.llm_engine.get_stats()
    speculative = _first_tokens(llm, prompt, NUM_SAMPLES)
    after = llm.llm_engine.get_stats()
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    assert drafted > NUM_SAMPLES // 4 and 0.03 * drafted < accepted < 0.9 * drafted  # acceptances and rejections
    assert _chi_square_p(plain, speculative) > 0.001


def test_a_biased_acceptance_rule_fails_the_same_test(sampling_setup, monkeypatch):
    """The test has the power to see a wrong rule: keep a rejected proposed token half the time."""
    import pagedllm.sampling.sampler as sampler_module

    prompt, plain, llm = sampling_setup
    exact = sampler_module.accept_proposal
    coin = torch.Generator().manual_seed(0)

    def biased(chosen, proposed):
        n = exact(chosen, proposed)
        while n < len(proposed) and torch.rand(1, generator=coin).item() < 0.5:
            n += 1  # the proposed token is kept where the target drew another
        return n

    monkeypatch.setattr(sampler_module, "accept_proposal", biased)
    speculative = _first_tokens(llm, prompt, NUM_SAMPLES)
    assert _chi_square_p(plain, speculative) < 0.001


# --- the draft model -----------------------------------------------------------------------


def _target_as_its_own_draft(model_path):
    """Two prompts (chunked: 16 tokens a step), greedy params, the plain engine's tokens, and an
    engine whose draft model is the target itself, proposing 4 tokens every step."""
    prompts = _prompts(2, [9, 30], seed=2)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kwargs = dict(max_model_len=256, num_gpu_blocks=256, max_num_batched_tokens=16, max_num_seqs=4)
    plain = _tokens(LLM(str(model_path), **kwargs).generate(prompts, params, use_tqdm=False))
    spec = {"method": "draft_model", "model": str(model_path), "num_speculative_tokens": 4, "adaptive": False}
    return prompts, params, plain, LLM(str(model_path), **kwargs, speculative_config=spec)


def test_a_draft_model_equal_to_the_target_has_every_greedy_proposal_accepted(small_vocab_model):
    """The draft keeps its own KV cache under the target's block tables, chunked prompts included:
    the same weights propose exactly the target's tokens."""
    prompts, params, plain, llm = _target_as_its_own_draft(small_vocab_model)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == plain
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0


def test_the_draft_model_is_skipped_while_nothing_speculates_and_catches_up_after(small_vocab_model, monkeypatch):
    """While the policy proposes nothing (prompt chunks, then a pause mid-decode) the draft runs
    no model pass; when speculation resumes it first computes the tokens it missed, so a draft
    equal to the target still has every proposal accepted, and outputs equal the plain engine's."""
    prompts, params, plain, llm = _target_as_its_own_draft(small_vocab_model)
    speculator = llm.llm_engine.speculator
    draft, choose = speculator.draft, speculator.controller.choose
    paused = [*range(0, 3), *range(5, 10)]  # the policy's calls (steps with decodes) that propose nothing
    forwards: list[int] = []  # the draft's passes before each call

    def pausing_choose(proposals, *args):
        forwards.append(draft.num_forwards)
        if len(forwards) - 1 in paused:
            return dict.fromkeys(proposals, 0)
        return choose(proposals, *args)

    monkeypatch.setattr(speculator.controller, "choose", pausing_choose)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == plain
    assert forwards[3] == 0 < forwards[4] < forwards[5] == forwards[10] < forwards[11]
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_another_draft_model_leaves_outputs_unchanged(small_vocab_model, tiny_models, mode):
    draft = tiny_models("llama", seed=1, vocab_size=SMALL_VOCAB, num_hidden_layers=1)
    prompts = _prompts(6, [9, 30, 17], seed=4)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 5 + [
        SamplingParams(n=2, temperature=1.0, top_k=5, seed=3, max_tokens=30, ignore_eos=True)
    ]
    kwargs = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8)
    plain = _tokens(LLM(str(small_vocab_model), **kwargs, num_gpu_blocks=512).generate(prompts, params, use_tqdm=False))
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(small_vocab_model), **kwargs, num_gpu_blocks=20, preemption_mode=mode, speculative_config=spec)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == plain
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.spec_decode_num_draft_tokens > 0


def test_a_draft_model_under_a_sliding_window_with_forks_and_prefix_hits(tiny_models):
    """With a window the draft computes every scheduled sequence each step, so a prefix-cache hit
    and a fork's child start where the target does (their first blocks have left the window): a
    draft equal to the target has every greedy proposal accepted, and outputs are unchanged."""
    model = tiny_models("mistral", vocab_size=SMALL_VOCAB, sliding_window=8)
    prompt = _prompts(1, [26], seed=6)[0]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    forked = SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=20, ignore_eos=True)
    kwargs = dict(max_model_len=128, block_size=4, num_gpu_blocks=256, enable_prefix_caching=True)
    plain = LLM(str(model), **kwargs)
    spec = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(model), **kwargs, speculative_config=spec)
    assert not llm.llm_engine.speculator.draft.lazy
    for prompts, params in (([prompt], greedy), ([prompt + [5, 6, 7, 8]], greedy)):  # the second hits the cache
        expected = _tokens(plain.generate(prompts, params, use_tqdm=False))
        assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == expected
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert stats.prefix_cache_hits > 0
    expected = _tokens(plain.generate([prompt], forked, use_tqdm=False))
    assert _tokens(llm.generate([prompt], forked, use_tqdm=False)) == expected


def test_a_draft_model_of_another_vocabulary_is_refused(small_vocab_model, tiny_models):
    draft = tiny_models("llama", vocab_size=2 * SMALL_VOCAB)
    with pytest.raises(ValueError, match="share the target's vocabulary"):
        LLM(str(small_vocab_model), max_model_len=128, num_gpu_blocks=64,
            speculative_config={"method": "draft_model", "model": str(draft)})


# --- the default model ---------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_copying_its_prompt_is_unchanged_and_accepts_most(smollm_llm, smollm_hf):
    """On the real model, an input-grounded prompt: greedy with n-gram speculation equals the
    engine without it and transformers, and most proposed tokens are accepted (both engines on
    float32 activations, `smollm_llm` too)."""
    from pagedllm.bench.spec import grounded_prompts

    prompts = [smollm_llm.apply_chat_template([{"role": "user", "content": message}])
               for _, message in grounded_prompts()[:2]]
    params = SamplingParams(temperature=0, max_tokens=64)
    plain = _tokens(smollm_llm.generate(prompts, params, use_tqdm=False))
    llm = LLM(kv_cache_memory=256 << 20, max_model_len=2048, int8_activations="off",
              speculative_config={"method": "ngram", "num_speculative_tokens": 8})
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == plain
    with torch.inference_mode():
        hf = smollm_hf.generate(torch.tensor([prompts[0]]), max_new_tokens=64, do_sample=False)
    assert plain[0][0] == hf[0, len(prompts[0]):].tolist()[: len(plain[0][0])]
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0.5 * stats.spec_decode_num_draft_tokens


def test_structured_outputs_speculate_under_their_grammar(tiny_llama):
    """A proposal is cut where the grammar forbids a token, and each verified position is masked
    by the grammar's state there: outputs are those without speculation, and valid."""
    import re

    from pagedllm.sampling_params import StructuredOutputsParams

    regex = r"(ab){3,12}c"
    prompts = random_prompts(3, [7, 12], seed=5)
    params = [
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex)),
        SamplingParams(temperature=0.8, seed=2, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex)),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, allowed_token_ids=list(range(200, 260))),
    ]
    kwargs = dict(max_model_len=256, num_gpu_blocks=256)
    plain = LLM(str(tiny_llama), **kwargs).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_llama), **kwargs, speculative_config={**NGRAM, "prompt_lookup_min": 1})
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(outputs) == _tokens(plain)
    assert all(re.fullmatch(regex, o.outputs[0].text) for o in outputs[:2])
    assert llm.llm_engine.get_stats().spec_decode_num_accepted_tokens > 0
