"""The engine end to end on a tiny random Llama, against transformers as the oracle."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.helpers import hf_greedy, load_hf, random_prompts

PROMPT_LENGTHS = [1, 3, 7, 12, 16, 17, 25, 31, 32, 33, 40, 55]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# The engines compared with transformers run on float32 activations, whatever the default.
EXACT = dict(int8_activations="off")


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return load_hf(tiny_llama)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(12, PROMPT_LENGTHS, seed=11)


@pytest.fixture(scope="module")
def expected(hf, prompts):
    return [hf_greedy(hf, p, 24, ignore_eos=True) for p in prompts]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), max_model_len=256, num_gpu_blocks=256, block_size=16, **EXACT)


def assert_all_free(llm):
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_free_cpu_blocks == stats.num_cpu_blocks
    assert not llm.llm_engine.has_unfinished_requests()


def test_greedy_batch_matches_transformers(llm, prompts, expected):
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    assert_all_free(llm)


def test_greedy_stops_at_eos_like_transformers(tiny_models, prompts, expected):
    """Without ignore_eos a sequence ends at EOS, which stays in the output as in transformers.
    The model is the same tiny Llama (same seed) with a token it often generates declared EOS."""
    eos = expected[0][5]
    path = tiny_models("llama", eos_token_id=eos)
    hf_eos = load_hf(path)
    llm = LLM(str(path), max_model_len=256, num_gpu_blocks=64, **EXACT)
    assert llm.llm_engine.eos_token_ids == [eos]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_eos, p, 24) for p in prompts]
    stopped = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert stopped and all(c.token_ids[-1] == eos and c.stop_reason is None for c in stopped)
    assert all(c.finish_reason == "length" and eos not in c.token_ids for o in outputs for c in o.outputs if c not in stopped)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_greedy_matches_under_preemption(tiny_llama, prompts, expected, block_size):
    max_model_len = 128
    llm = LLM(
        str(tiny_llama),
        block_size=block_size,
        max_model_len=max_model_len,
        num_gpu_blocks=max_model_len // block_size + 1,
        swap_space=0,
        max_num_seqs=12,
        **EXACT,
    )
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_recompute_preemptions == stats.num_preemptions
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_all_free(llm)


def test_chunked_prefill_matches(tiny_llama, prompts, expected):
    llm = LLM(str(tiny_llama), max_model_len=256, num_gpu_blocks=128, max_num_batched_tokens=8, max_num_seqs=8, **EXACT)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_reference_and_prefix_cached_runs_agree(tiny_llama, prompts, expected):
    """A second pass over the same prompts hits the prefix cache and still produces the same tokens."""
    llm = LLM(str(tiny_llama), max_model_len=256, num_gpu_blocks=256, enable_prefix_caching=True, **EXACT)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    hits_before = llm.llm_engine.get_stats().prefix_cache_hits
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.llm_engine.get_stats().prefix_cache_hits > hits_before
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_blocks_are_free_after_finish_and_abort(llm, prompts):
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"abort-test-{i}", p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.get_stats().num_free_blocks < engine.get_stats().num_total_blocks
    engine.abort_request([f"abort-test-{i}" for i in range(0, 12, 2)])
    assert engine.get_stats().num_running == 6
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_free(llm)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(llm, prompts):
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=42, max_tokens=20, ignore_eos=True)
    alone = llm.generate([prompts[3]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(prompts, [others] * 3 + [seeded] + [others] * 8, use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone
    again = llm.generate([prompts[3]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    other_seed = SamplingParams(temperature=0.8, top_p=0.9, seed=43, max_tokens=20, ignore_eos=True)
    assert llm.generate([prompts[3]], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_stop_strings_trim_the_text(llm):
    prompt = "Once upon a time"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    text = full.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    cut = text.index(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]), use_tqdm=False)[0]
    assert out.outputs[0].text == text[:cut]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
    kept = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    out = llm.generate(prompt, kept, use_tqdm=False)[0]
    assert out.outputs[0].text == text[: cut + len(stop)]


def test_stop_token_ids_and_min_tokens(llm, prompts, expected):
    tokens = expected[5]
    stop_token = tokens[4]
    first = tokens.index(stop_token)
    out = llm.generate(prompts[5], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_token]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == tokens[: first + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop_token)
    # min_tokens keeps the stop token from being chosen before 8 tokens are out.
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[tokens[0]], min_tokens=8)
    out = llm.generate(prompts[5], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 8 and tokens[0] not in out.token_ids[:8]


def test_max_tokens_and_model_length_end_with_length(llm, prompts):
    out = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    long_prompt = random_prompts(1, [250], seed=9)[0]
    out = llm.generate(long_prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 256 - 250  # stops at max_model_len


def test_logprobs_and_prompt_logprobs_match_transformers(llm, hf, prompts):
    prompt = prompts[6]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    full = prompt + completion.token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), -1)
    total = 0.0
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(prompt) - 1 + step]
        assert token in entry and entry[token].rank == 1
        assert math.isclose(entry[token].logprob, row[token].item(), abs_tol=1e-4)
        top3 = row.topk(3).indices.tolist()
        assert set(top3) <= set(entry)
        assert entry[token].decoded_token == llm.get_tokenizer().decode([token])
        total += entry[token].logprob
    assert math.isclose(completion.cumulative_logprob, total, abs_tol=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert math.isclose(entry[prompt[pos]].logprob, ref[pos - 1, prompt[pos]].item(), abs_tol=1e-4)


def test_prompt_logprobs_compute_their_logits_a_bounded_piece_at_a_time(llm, hf, prompts, monkeypatch):
    """Issue 51 item 6: a prompt chunk's logits for prompt_logprobs were computed at once (2 GiB
    of float32 for 2,048 tokens of a 262k vocabulary, and its log-softmax as much again). Under
    a bound of 5 rows' bytes, every head call holds at most 5 rows, and the values are
    transformers'."""
    from pagedllm.worker import model_runner

    runner = llm.llm_engine.executor.worker.runner
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_BYTES", 5 * 4 * runner.vocab_size + 3)
    rows_per_call = []
    compute = runner.model.compute_logits
    monkeypatch.setattr(runner.model, "compute_logits", lambda hidden: rows_per_call.append(len(hidden)) or compute(hidden))
    prompt = prompts[6]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=4), use_tqdm=False)[0]
    assert max(rows_per_call) == 5 and sum(rows_per_call) == len(prompt) - 1 + 1  # the pieces, then the sample row
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    for pos in range(1, len(prompt)):
        entry, row = out.prompt_logprobs[pos], ref[pos - 1]
        assert math.isclose(entry[prompt[pos]].logprob, row[prompt[pos]].item(), abs_tol=1e-4)
        assert entry[prompt[pos]].rank == int((row > row[prompt[pos]]).sum()) + 1
        assert [t for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)][:4] == row.topk(4).indices.tolist()


def test_bad_requests_raise_clear_errors_and_leave_the_engine_working(llm, prompts, expected):
    with pytest.raises(ValueError, match="max_model_len is 256"):
        llm.generate([prompts[0], list(range(100, 400))], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # the good prompt was withdrawn too
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 49152\)"):
        llm.generate([[1, 2, 10**6]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"n=300 exceeds this engine's limit max_n=16 \(--max-n\)"):
        llm.generate(prompts[0], SamplingParams(n=300, temperature=1.0), use_tqdm=False)
    with pytest.raises(ValueError, match=r"beam width of 17 exceeds this engine's limit max_beam_width=16"):
        llm.generate(prompts[0], SamplingParams(n=17, use_beam_search=True, temperature=0), use_tqdm=False)
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(prompts[:3], [GREEDY, GREEDY], use_tqdm=False)
    llm.llm_engine.add_request("dup", prompts[0], GREEDY)
    with pytest.raises(ValueError, match="already running"):
        llm.llm_engine.add_request("dup", prompts[1], GREEDY)
    llm.llm_engine.abort_request("dup")
    outputs = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected[:2]


def test_budget_too_small_for_one_sequence_fails_at_startup(tiny_llama):
    with pytest.raises(ValueError, match="Raise kv_cache_memory to at least"):
        LLM(str(tiny_llama), max_model_len=512, num_gpu_blocks=4, block_size=16)
    with pytest.raises(TypeError, match="Unknown engine argument"):
        LLM(str(tiny_llama), blocksize=16)


def test_chat_uses_the_chat_template(llm):
    messages = [{"role": "user", "content": "Hello there"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(out.prompt_token_ids).endswith("<|im_start|>assistant\n")


def test_stats_snapshot_counts_tokens(tiny_llama, prompts):
    llm = LLM(str(tiny_llama), max_model_len=256, num_gpu_blocks=64, enable_prefix_caching=False)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    num_prompt = sum(len(p) for p in prompts[:4])
    assert stats.num_prompt_tokens == num_prompt
    assert stats.num_generation_tokens == 20
    assert stats.num_computed_tokens == num_prompt + 4 * 4  # the 5th token of each is never fed back
    assert stats.num_running == stats.num_waiting == stats.num_preemptions == 0


def test_a_failed_step_still_tells_the_workers_which_requests_finished(tiny_llama, monkeypatch):
    """A step's message carries the requests that finished since the last one, so that workers
    drop their state (a seeded request's generator). If that step raises, the next one carries them."""
    engine = LLM(str(tiny_llama), max_model_len=128, num_gpu_blocks=32).llm_engine
    sampler = engine.executor.worker.runner.sampler
    engine.add_request("seeded", [5, 6, 7], SamplingParams(temperature=1.0, seed=3, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert any(key[0] == "seeded" for key in sampler._generators)  # dropped with the next step's message

    real, failed = engine.executor.execute, []

    def fail_once(scheduled):
        if not failed:
            failed.append(scheduled)
            raise RuntimeError("injected fault")
        return real(scheduled)

    monkeypatch.setattr(engine.executor, "execute", fail_once)
    engine.add_request("next", [8, 9], SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.step()
    assert failed[0].finished_request_ids == ["seeded"]
    engine.abort_request("next")  # what the server's recovery does with the requests in flight
    engine.add_request("probe", [8, 9], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert not any(key[0] == "seeded" for key in sampler._generators)


def test_greedy_past_a_sliding_window_matches_transformers(tiny_models, prompts):
    """A Mistral whose window (9 tokens) is shorter than most prompts and outputs: the engine's
    context is no longer cut at the window, and every layer attends only within it."""
    path = tiny_models("mistral", sliding_window=9)
    hf_window = load_hf(path)
    llm = LLM(str(path), max_model_len=256, num_gpu_blocks=128, max_num_batched_tokens=16, max_num_seqs=8, **EXACT)
    assert llm.llm_engine.max_model_len == 256
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_window, p, 24, ignore_eos=True) for p in prompts]
