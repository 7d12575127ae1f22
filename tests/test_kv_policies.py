"""The paper's baselines run the real model: contiguous reservations feed the same paged kernels
through block tables that are runs of consecutive blocks, so every policy must produce exactly
the tokens the engine produces with paged memory, and report its KV memory breakdown."""

from __future__ import annotations

import pytest

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.core.kv_breakdown import PARTS
from tests.helpers import hf_greedy, load_hf, random_prompts

POLICIES = ["orca-oracle", "orca-pow2", "orca-max", "static"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def make_llm(path, policy: str, **kwargs) -> LLM:
    # float32 activations (int8_activations="off"): the outputs are compared with transformers'
    args = dict(max_model_len=128, num_gpu_blocks=64, block_size=8, kv_policy=policy, enable_prefix_caching=False,
                int8_activations="off")
    args.update(kwargs)
    return LLM(str(path), **args)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, [3, 9, 16, 17, 30, 41], seed=5)


@pytest.fixture(scope="module")
def expected(tiny_llama, prompts):
    hf = load_hf(tiny_llama)
    return [hf_greedy(hf, p, 16, ignore_eos=True) for p in prompts]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_decodes_greedily_like_transformers(tiny_llama, prompts, expected, policy):
    llm = make_llm(tiny_llama, policy)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions == 0
    assert stats.num_free_blocks == stats.num_total_blocks
    assert set(stats.kv_breakdown) == set(PARTS)
    assert sum(stats.kv_breakdown.values()) == pytest.approx(1.0)
    assert stats.kv_breakdown["reservation"] > 0  # slots set aside for tokens still to come


@pytest.mark.parametrize("policy", ["orca-oracle", "static"])
def test_samples_and_beams_with_copied_blocks_equal_the_paged_engine(tiny_llama, prompts, policy):
    sampling = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=10, ignore_eos=True)
    beams = BeamSearchParams(beam_width=3, max_tokens=8)
    paged = make_llm(tiny_llama, "paged")
    reserved = make_llm(tiny_llama, policy)
    want = paged.generate(prompts[:3], sampling, use_tqdm=False)
    got = reserved.generate(prompts[:3], sampling, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    want_beams = paged.beam_search([{"prompt_token_ids": p} for p in prompts[:2]], beams)
    got_beams = reserved.beam_search([{"prompt_token_ids": p} for p in prompts[:2]], beams)
    assert [[s.tokens for s in b.sequences] for b in got_beams] == [[s.tokens for s in b.sequences] for b in want_beams]
    assert reserved.llm_engine.block_manager.num_blocks_copied > 0  # forks copied, nothing shared
    stats = reserved.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_paged_memory_holds_far_more_token_states_than_max_reservations(tiny_llama, prompts):
    shares = {}
    for policy in ("paged", "orca-max"):
        llm = make_llm(tiny_llama, policy, num_gpu_blocks=48)
        llm.generate(prompts * 2, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        shares[policy] = llm.llm_engine.get_stats().kv_breakdown
    assert shares["paged"]["reservation"] == 0
    assert shares["paged"]["token_states"] > 2 * shares["orca-max"]["token_states"]
    assert shares["orca-max"]["internal_fragmentation"] > shares["paged"]["internal_fragmentation"]


def test_a_reservation_too_large_for_the_cache_is_refused_at_admission(tiny_llama):
    llm = make_llm(tiny_llama, "orca-max", num_gpu_blocks=16)  # one max-length run: 16 blocks of 8
    with pytest.raises(ValueError, match="can never fit"):
        llm.llm_engine.add_request("wide", [5, 6, 7], SamplingParams(n=2, temperature=1.0, max_tokens=8))
