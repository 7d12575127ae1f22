"""Sliding windows end to end: a Mistral whose every layer slides and a Qwen2 hybrid (layer 0
full, layer 1 sliding), with windows shorter than the prompts, against transformers; and the
blocks that left the window really go back to the pool (a Mistral sequence holds a bounded
number of blocks; the hybrid holds its full layer's blocks plus the window's)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.kv_spec import first_block_in_window, max_blocks_spanned
from pagedllm.utils import cdiv
from tests.helpers import hf_greedy, load_hf, random_prompts
from tests.test_sharing import hf_beams

WINDOW = 9
MODELS = {
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    "hybrid": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
}
# Block edges crossed every 4 tokens; prompts longer than the 16-token budget are chunked.
# float32 activations (int8_activations="off"): the outputs are compared with transformers'.
ENGINE = dict(max_model_len=512, block_size=4, max_num_batched_tokens=16, max_num_seqs=8, int8_activations="off")
PROMPT_LENGTHS = [3, 9, 17, 30, 41]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tiny_models):
    arch, overrides = MODELS[request.param]
    path = tiny_models(arch, **overrides)
    return request.param, path, load_hf(path)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(len(PROMPT_LENGTHS), PROMPT_LENGTHS, seed=23)


def _expected(hf, prompts, max_tokens=20):
    return [hf_greedy(hf, p, max_tokens, ignore_eos=True) for p in prompts]


def _assert_all_free(llm):
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_free_cpu_blocks == stats.num_cpu_blocks


def test_greedy_with_windows_shorter_than_the_prompts_matches_transformers(model, prompts):
    name, path, hf = model
    llm = LLM(str(path), num_gpu_blocks=256, **ENGINE)
    windows = [group.sliding_window for group in llm.llm_engine.core.executor.kv_cache_groups]
    assert windows == ([WINDOW] if name == "mistral" else [None, WINDOW])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == _expected(hf, prompts)
    assert llm.llm_engine.block_manager.num_window_frees > 0
    _assert_all_free(llm)


def test_a_long_generation_gives_back_the_blocks_that_left_the_window(model):
    """After every step the windowed group holds exactly the blocks from its window's first one
    on (a bounded number, whatever the length), and a full-attention group every block."""
    name, path, hf = model
    llm = LLM(str(path), num_gpu_blocks=256, **ENGINE)
    engine, bm = llm.llm_engine, llm.llm_engine.block_manager
    prompt = random_prompts(1, [20], seed=5)[0]
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    seq = engine.requests.groups["long"].seqs[0]
    bound = max_blocks_spanned(WINDOW - 1 + 1, 4)  # a decode step's window and token: 3 blocks of 4
    most_windowed = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if not bm.has_blocks(seq.seq_id):
            break
        c = seq.num_computed_tokens
        *full, windowed = bm.block_tables(seq.seq_id)
        live = [b for b in windowed if b is not None]
        assert len(windowed) == cdiv(c, 4) and len(live) == cdiv(c, 4) - first_block_in_window(WINDOW, c, 4)
        if c > 16:  # past the prompt's chunks: only decode steps
            most_windowed = max(most_windowed, len(live))
            assert len(live) <= bound
        for table in full:  # the hybrid's full layer keeps all its blocks
            assert None not in table and len(table) == cdiv(c, 4)
        held = bm.num_blocks_held(seq.seq_id)
        assert held == len(live) + (cdiv(c, 4) if name == "hybrid" else 0)
    assert most_windowed == bound
    assert outputs[0].outputs[0].token_ids == hf_greedy(hf, prompt, 120, ignore_eos=True)
    _assert_all_free(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_outputs_are_identical_to_transformers_under_preemption(model, mode):
    """Long prompts first, so short ones decode while the long ones still take chunks: the
    newest (decoding) ones are preempted, by swap or by recompute."""
    name, path, hf = model
    prompts = random_prompts(5, [41, 30, 3, 9, 17], seed=23)
    blocks = 8 if name == "mistral" else 28  # too few for all five at once
    engine = {**ENGINE, "max_model_len": 80}
    llm = LLM(str(path), num_gpu_blocks=blocks, swap_space=0.01, preemption_mode=mode, **engine)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == _expected(hf, prompts)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swap_preemptions > 0 and stats.num_blocks_swapped_in > 0
    else:
        assert stats.num_recompute_preemptions > 0
    _assert_all_free(llm)


def test_prefix_cache_hits_past_the_window_give_the_same_tokens(model):
    name, path, hf = model
    llm = LLM(str(path), num_gpu_blocks=256, **ENGINE)
    first = random_prompts(1, [40], seed=9)[0]
    second = first[:37] + random_prompts(1, [6], seed=10)[0]
    outputs = llm.generate([first], GREEDY, use_tqdm=False) + llm.generate([second], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == _expected(hf, [first, second])
    # 36 of its tokens (9 full blocks) come from the first prompt's cached blocks; in the
    # windowed group only those the window still sees were needed.
    assert outputs[1].num_cached_tokens == 36
    _assert_all_free(llm)


def test_parallel_samples_with_windows_are_the_models_own(model):
    """n samples forked from one prompt (copy-on-write of the shared last block in every group,
    windows moving per sample): each sample's log-probabilities are transformers' on that
    sample's own tokens, so no sample read another's keys or a block that left its window."""
    name, path, hf = model
    prompt = random_prompts(1, [22], seed=13)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True, logprobs=0)
    llm = LLM(str(path), num_gpu_blocks=256, **ENGINE)
    shared = llm.generate(prompt, params, use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in shared.outputs}) == 3
    bm = llm.llm_engine.block_manager
    assert bm.num_copy_on_writes == 2 * bm.num_groups and bm.num_window_frees > 0
    for sample in shared.outputs:
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + sample.token_ids])).logits[0].float()
        want = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        want = want[torch.arange(len(sample.token_ids)), torch.tensor(sample.token_ids)]
        got = torch.tensor([step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_beam_search_with_windows_matches_transformers(model):
    name, path, hf = model
    llm = LLM(str(path), num_gpu_blocks=256, **ENGINE)
    prompts = random_prompts(2, [14, 27], seed=17)
    params = BeamSearchParams(beam_width=3, max_tokens=14)
    for prompt, result in zip(prompts, llm.beam_search(prompts, params)):
        ours = [seq.tokens[len(prompt):] for seq in result.sequences]
        assert ours == hf_beams(hf, prompt, 3, 14, -1, eos_token_id=-1)
    _assert_all_free(llm)


def test_admission_counts_only_the_blocks_a_window_keeps(tiny_models):
    """8 blocks of 4 tokens hold 32 token slots: with every layer sliding (window 9), a 30-token
    prompt may still generate to the end of a 160-token context. The hybrid's full layer needs
    every block: its bound is that plus the window's (and two samples share only the prompt's
    full blocks there)."""
    mistral = LLM(str(tiny_models(MODELS["mistral"][0], **MODELS["mistral"][1])), num_gpu_blocks=8,
                  **{**ENGINE, "max_model_len": 160})
    prompt = random_prompts(1, [30], seed=3)[0]
    out = mistral.generate(prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 160 - 30
    # 40 blocks: a 132-token sequence takes 33 of the full layer (the last token's KV is never
    # written) and at most 7 of the windowed one (its window and a 16-token chunk).
    hybrid = LLM(str(tiny_models(MODELS["hybrid"][0], **MODELS["hybrid"][1])), num_gpu_blocks=40,
                 **{**ENGINE, "max_model_len": 132})
    out = hybrid.generate(prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 132 - 30
    # Two samples: 7 shared prompt blocks + 2 x 26 in the full layer, 2 x 7 in the windowed one.
    two = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=100, ignore_eos=True)
    with pytest.raises(ValueError, match=r"2 sequences \(samples\) of up to 30 prompt \+ 100 output tokens need up "
                                         r"to 73 blocks of 4 tokens, but the cache has 40"):
        hybrid.generate(prompt, two, use_tqdm=False)
    with pytest.raises(ValueError, match=r"needs \(47 blocks\)"):
        LLM(str(tiny_models(MODELS["hybrid"][0], **MODELS["hybrid"][1])), num_gpu_blocks=40, **{**ENGINE, "max_model_len": 160})
