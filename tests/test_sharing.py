"""Memory sharing: parallel sampling, beam search and prefix caching, with copy-on-write."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.core import Sequence
from tests.helpers import load_hf, random_prompts


def make_llm(path, **kwargs):
    # float32 activations (int8_activations="off"): the outputs are compared with transformers'
    args = dict(max_model_len=256, num_gpu_blocks=256, block_size=16, int8_activations="off")
    args.update(kwargs)
    return LLM(str(path), **args)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return load_hf(tiny_llama)


def hf_beams(hf, prompt, width, max_tokens, eos, **kwargs):
    """transformers' beam search: all `width` returned sequences, EOS-terminated ones cut after EOS."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
            do_sample=False, max_new_tokens=max_tokens, pad_token_id=0, **kwargs,
        )
    beams = []
    for row in out.tolist():
        generated = row[len(prompt):]
        beams.append(generated[: generated.index(eos) + 1] if eos in generated else generated)
    return beams


# --- parallel sampling -------------------------------------------------------------------------


def test_parallel_samples_equal_unshared_runs_of_the_same_seed(tiny_llama):
    prompts = random_prompts(3, [13, 16, 21], seed=4)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    shared = make_llm(tiny_llama, enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)
    unshared = make_llm(tiny_llama, enable_prefix_caching=False, enable_block_sharing=False).generate(prompts, params, use_tqdm=False)
    for a, b in zip(shared, unshared):
        assert [c.index for c in a.outputs] == [0, 1, 2, 3]
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # the samples differ
    # Sample i of a seeded request is the same as asking for it alone with that sample index
    # (here: sample 0 equals n=1 with the same seed).
    single = make_llm(tiny_llama).generate(prompts[0], SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert single[0].outputs[0].token_ids == shared[0].outputs[0].token_ids


def test_best_of_returns_the_n_most_likely_samples(tiny_llama):
    llm = make_llm(tiny_llama)
    prompt = random_prompts(1, [10], seed=8)[0]
    everything = llm.generate(prompt, SamplingParams(n=6, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    best = llm.generate(prompt, SamplingParams(n=2, best_of=6, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    ranked = sorted(everything.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]


def _step_until_forked(llm, request_id, prompt, params):
    engine = llm.llm_engine
    engine.add_request(request_id, prompt, params)
    group = engine.requests.groups[request_id]
    while not group.forked:
        engine.step()
    return engine, group


@pytest.mark.parametrize("prompt_len, expected_copies", [(20, 3), (32, 0)])
def test_fork_shares_prompt_blocks_and_copies_only_a_partial_last_block(tiny_llama, prompt_len, expected_copies):
    llm = make_llm(tiny_llama, enable_prefix_caching=False)
    prompt = random_prompts(1, [prompt_len], seed=1)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=3, ignore_eos=True)
    engine, group = _step_until_forked(llm, "fork", prompt, params)
    bm = engine.block_manager
    tables = [bm.block_ids(s.seq_id) for s in group.seqs]
    assert len(group.seqs) == 4 and all(t == tables[0] for t in tables)  # one set of blocks...
    assert [bm.ref_count(b) for b in tables[0]] == [4] * len(tables[0])  # ...referenced 4 times
    copies_before = bm.num_copy_on_writes
    engine.step()  # each sample writes its first token's key/value
    assert bm.num_copy_on_writes - copies_before == expected_copies
    tables = [bm.block_ids(s.seq_id) for s in group.seqs]
    full = prompt_len // 16
    assert all(t[:full] == tables[0][:full] for t in tables)  # full blocks stay shared
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert all(block.ref_count == 0 for block in bm.pool.blocks)


def test_sharing_saves_blocks_for_parallel_samples(tiny_llama):
    prompt = random_prompts(1, [100], seed=2)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=2, max_tokens=4, ignore_eos=True)
    used = {}
    for sharing in (True, False):
        engine, _ = _step_until_forked(make_llm(tiny_llama, enable_prefix_caching=False, enable_block_sharing=sharing), "r", prompt, params)
        engine.step()
        used[sharing] = engine.get_stats().num_total_blocks - engine.get_stats().num_free_blocks
    assert used[True] == 6 + 4 * 1  # 6 full prompt blocks shared, one private last block each
    assert used[False] == 4 * 7


# --- beam search -------------------------------------------------------------------------------


def test_beam_search_matches_transformers(tiny_models, tiny_llama):
    # The tiny Llama with a token it often produces declared EOS, so that beams also end early.
    prompts = random_prompts(4, [5, 17, 33, 9], seed=12)
    greedy = make_llm(tiny_llama).generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    tokens = [t for o in greedy for t in o.outputs[0].token_ids]
    eos = max(set(tokens), key=tokens.count)
    path = tiny_models("llama", eos_token_id=eos)
    hf = load_hf(path)
    llm = make_llm(path)
    ended_early = 0
    for width, length_penalty, early_stopping in [(2, 1.0, False), (3, 0.6, True), (4, 2.0, "never"), (4, 1.0, False)]:
        params = BeamSearchParams(beam_width=width, max_tokens=12, length_penalty=length_penalty, early_stopping=early_stopping)
        for prompt, result in zip(prompts, llm.beam_search(prompts, params)):
            ours = [s.tokens[len(prompt):] for s in result.sequences]
            assert ours == hf_beams(hf, prompt, width, 12, eos, length_penalty=length_penalty, early_stopping=early_stopping)
            ended_early += sum(s.tokens[-1] == eos for s in result.sequences)
    assert ended_early > 0
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_beam_search_through_sampling_params_and_block_accounting(tiny_llama, hf):
    llm = make_llm(tiny_llama, enable_prefix_caching=False)
    prompt = random_prompts(1, [40], seed=13)[0]
    params = SamplingParams(n=3, best_of=3, use_beam_search=True, temperature=0, max_tokens=6, ignore_eos=True)
    engine = llm.llm_engine
    engine.add_request("beam", prompt, params)
    group = engine.requests.groups["beam"]
    peak_beams = 0
    while engine.has_unfinished_requests():
        engine.step()
        live = group.unfinished_seqs()
        peak_beams = max(peak_beams, len(live))
        if live and not group.is_finished:
            refs = [engine.block_manager.ref_count(b) for b in engine.block_manager.block_ids(live[0].seq_id)[:2]]
            assert refs == [len(live)] * 2  # the prompt's full blocks are shared by every beam
    assert peak_beams == 3
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == hf_beams(hf, prompt, 3, 6, -1, eos_token_id=-1)
    assert engine.get_stats().num_free_blocks == engine.get_stats().num_total_blocks


def test_beam_search_logprobs_are_the_models_own(tiny_llama, hf):
    """Each returned beam's tokens carry their log-probability, rank and the top k under the
    model's distribution at that position (transformers' logits on the beam's own prefix), as a
    sampled token does; they were placeholders (no entries: "" tokens, null and -9999 values)."""
    llm = make_llm(tiny_llama)
    prompt = random_prompts(1, [11], seed=14)[0]
    k = 3
    params = SamplingParams(n=3, best_of=3, use_beam_search=True, temperature=0, max_tokens=5, ignore_eos=True, logprobs=k)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for completion in out.outputs:
        tokens = completion.token_ids
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, dim=-1)
        assert len(completion.logprobs) == len(tokens)
        for position, (token, entry) in enumerate(zip(tokens, completion.logprobs)):
            row = expected[position]
            top_values, top_ids = torch.topk(row, k)
            assert set(top_ids.tolist()) <= set(entry) and token in entry
            for rank, (t, v) in enumerate(zip(top_ids.tolist(), top_values.tolist()), start=1):
                assert entry[t].rank == rank and entry[t].logprob == pytest.approx(v, abs=1e-4)
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            assert entry[token].decoded_token == llm.get_tokenizer().decode([token])
        assert completion.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(tokens, completion.logprobs)), abs=1e-3)


# --- prefix caching ----------------------------------------------------------------------------


def test_second_request_with_a_common_prefix_computes_only_its_own_tokens(tiny_llama):
    prefix = random_prompts(1, [64], seed=20)[0]
    first, second = prefix + [500, 501, 502], prefix + [600, 601, 602, 603, 604]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm = make_llm(tiny_llama)
    out_first = llm.generate(first, params, use_tqdm=False)[0]
    before = llm.llm_engine.get_stats()
    out_second = llm.generate(second, params, use_tqdm=False)[0]
    after = llm.llm_engine.get_stats()
    assert out_second.num_cached_tokens == 64
    assert after.prefix_cache_hits - before.prefix_cache_hits == 64
    assert after.prefix_cache_queries - before.prefix_cache_queries == len(second)
    # Only the 5 new prompt tokens, then 4 decode steps, went through the model.
    assert after.num_computed_tokens - before.num_computed_tokens == (len(second) - 64) + 4
    off = make_llm(tiny_llama, enable_prefix_caching=False)
    expected = off.generate([first, second], params, use_tqdm=False)
    assert [out_first.outputs[0].token_ids, out_second.outputs[0].token_ids] == [o.outputs[0].token_ids for o in expected]


def test_a_fully_cached_prompt_still_computes_its_last_token(tiny_llama):
    prompt = random_prompts(1, [48], seed=21)[0]  # exactly three blocks
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm = make_llm(tiny_llama)
    a = llm.generate(prompt, params, use_tqdm=False)[0]
    b = llm.generate(prompt, params, use_tqdm=False)[0]
    assert b.num_cached_tokens == 32  # the last block is recomputed for the last token's logits
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_cached_blocks_are_evicted_least_recently_used_first_chain_tail_first(tiny_llama):
    # 16 blocks. Two 3-block prompts stay cached after they finish; then a 12-block prompt takes
    # the 10 never-used blocks and must evict 2 cached ones: the older prompt's, tail first.
    llm = make_llm(tiny_llama, num_gpu_blocks=16, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    old, recent = random_prompts(2, [48], seed=22)
    llm.generate(old, params, use_tqdm=False)
    llm.generate(recent, params, use_tqdm=False)
    llm.generate(random_prompts(1, [192], seed=23)[0], params, use_tqdm=False)
    # Look the prompts up without admitting them (admitting would itself evict).
    lookup = llm.llm_engine.block_manager.find_cached_prefix
    hits = [len(lookup(Sequence(-1 - i, p))) for i, p in enumerate((recent, old))]
    assert hits == [2, 1]  # recent intact (2 = all but the last block); old lost its tail only


# --- mixed decoding ----------------------------------------------------------------------------


def test_mixed_decoding_methods_in_one_batch_equal_separate_runs(tiny_llama):
    prompts = random_prompts(4, [9, 18, 27, 36], seed=30)
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=50, seed=5, max_tokens=8, ignore_eos=True),
        SamplingParams(n=3, temperature=1.0, seed=6, max_tokens=8, ignore_eos=True),
        SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0, max_tokens=8, ignore_eos=True),
    ]
    llm = make_llm(tiny_llama)
    together = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, together):
        alone = make_llm(tiny_llama).generate(prompt, p, use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone.outputs]
    assert [len(o.outputs) for o in together] == [1, 1, 3, 2]
