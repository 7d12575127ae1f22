"""Embeddings (`LLM.embed`, pooling requests) on tiny random models with float32 activations,
checked against transformers' final hidden states on the same weights (`last_hidden_state`,
after the model's final norm), pooled the same way: the last token, the mean, the first; raw or
L2-normalized; cut to `dimensions`; through chunked prompts, the prefix cache, a batch of
different lengths, beside generation, and over two tensor-parallel workers."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.pooling_params import PoolingParams, pooling_asked
from tests.helpers import load_hf, random_prompts

CHUNK = 16  # max_num_batched_tokens: a 40-token prompt takes three steps
# Different lengths: one past two chunks, one of a single token, others in between.
PROMPTS = random_prompts(4, [40, 1, 17, 9], seed=11)
ATOL = 1e-4


def engine(path, **kwargs) -> LLM:
    return LLM(str(path), max_model_len=256, kv_cache_memory=16 << 20, int8_activations="off",
               max_num_batched_tokens=CHUNK, max_num_seqs=8, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return engine(tiny_llama)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return load_hf(tiny_llama)


def oracle(hf_model, prompt: list[int], pooling_type: str, normalize: bool, dimensions: int | None = None):
    """transformers' final hidden states of `prompt`, pooled, cut and normalized."""
    with torch.inference_mode():
        hidden = hf_model.model(torch.tensor([prompt])).last_hidden_state[0]  # [tokens, hidden]
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling_type]
    if dimensions is not None:
        vector = vector[:dimensions]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def assert_close(embedding: list[float], expected: torch.Tensor) -> None:
    assert len(embedding) == len(expected)
    assert torch.allclose(torch.tensor(embedding), expected, atol=ATOL), (torch.tensor(embedding) - expected).abs().max()


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("pooling_type", ["last", "mean", "cls"])
def test_a_batch_of_prompts_embeds_as_transformers_pools_its_hidden_states(llm, hf, pooling_type, normalize):
    outputs = llm.embed(PROMPTS, PoolingParams(pooling_type=pooling_type, normalize=normalize), use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    for prompt, output in zip(PROMPTS, outputs):
        assert_close(output.outputs.embedding, oracle(hf, prompt, pooling_type, normalize))
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_dimensions_keep_the_first_components_normalized_after_the_cut(llm, hf, pooling_type, normalize):
    params = PoolingParams(pooling_type=pooling_type, normalize=normalize, dimensions=10)
    for prompt, output in zip(PROMPTS, llm.embed(PROMPTS, params, use_tqdm=False)):
        assert_close(output.outputs.embedding, oracle(hf, prompt, pooling_type, normalize, dimensions=10))


def test_the_default_is_the_last_token_normalized_and_encode_gives_a_tensor(llm, hf):
    (embedded,) = llm.embed(PROMPTS[0], use_tqdm=False)
    assert_close(embedded.outputs.embedding, oracle(hf, PROMPTS[0], "last", True))
    (encoded,) = llm.encode([PROMPTS[0]], use_tqdm=False)
    assert isinstance(encoded.outputs.data, torch.Tensor) and encoded.outputs.data.dtype == torch.float32
    assert encoded.outputs.data.tolist() == embedded.outputs.embedding


def test_a_last_token_pool_reuses_the_prefix_cache_and_mean_pools_compute_every_position(llm, hf):
    """LAST needs only the last position, which is always computed; MEAN needs every one, so it
    takes no cached prefix. Both are right either way."""
    prompt = random_prompts(1, [48], seed=12)[0]
    for pooling_type in ("last", "mean", "last"):  # the first call fills the cache for the others
        (output,) = llm.encode([prompt], PoolingParams(pooling_type=pooling_type), use_tqdm=False)
        assert_close(output.outputs.embedding, oracle(hf, prompt, pooling_type, True))
        last_cached = output.num_cached_tokens
    assert last_cached == 32  # two full blocks of 16 (the last token is left to compute)
    (mean,) = llm.encode([prompt], PoolingParams(pooling_type="mean"), use_tqdm=False)
    assert mean.num_cached_tokens == 0


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, hf):
    prompt = PROMPTS[0]
    (output,) = llm.embed([prompt], PoolingParams(pooling_type="mean"), truncate_prompt_tokens=7, use_tqdm=False)
    assert output.prompt_token_ids == prompt[-7:]
    assert_close(output.outputs.embedding, oracle(hf, prompt[-7:], "mean", True))


def test_a_prompt_the_context_cannot_hold_and_too_many_dimensions_are_refused(llm):
    with pytest.raises(ValueError, match="max_model_len=256"):
        llm.embed([[5] * 257], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions=65 is more than this model's 64"):
        llm.embed([[5, 6]], PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.embed([[]], use_tqdm=False)
    (whole,) = llm.embed([[5] * 256], use_tqdm=False)  # a whole context: nothing is generated after it
    assert len(whole.outputs.embedding) == 64
    assert_all_blocks_free(llm)


def test_generation_beside_pooling_gives_the_same_greedy_tokens_as_alone(llm, hf):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    generation_prompts = random_prompts(3, [23, 5, 31], seed=13)
    alone = [o.outputs[0].token_ids for o in llm.generate(generation_prompts, greedy, use_tqdm=False)]
    engine_ = llm.llm_engine
    pooling = PoolingParams(pooling_type="mean")
    for i, prompt in enumerate(generation_prompts):
        engine_.add_request(f"gen-{i}", prompt, greedy)
        engine_.add_request(f"pool-{i}", PROMPTS[i], pooling)  # admitted between the generation requests
    finished = {}
    while engine_.has_unfinished_requests():
        for output in engine_.step():
            if output.finished:
                finished[output.request_id] = output
    assert [finished[f"gen-{i}"].outputs[0].token_ids for i in range(3)] == alone
    for i in range(3):
        assert_close(finished[f"pool-{i}"].outputs.embedding, oracle(hf, PROMPTS[i], "mean", True))
    assert_all_blocks_free(llm)


def test_the_engines_pooler_config_sets_the_default(tiny_llama, hf):
    llm = engine(tiny_llama, pooler_config={"pooling_type": "MEAN", "normalize": False})
    try:
        (output,) = llm.embed([PROMPTS[2]], use_tqdm=False)
        assert_close(output.outputs.embedding, oracle(hf, PROMPTS[2], "mean", False))
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("family, overrides", [
    ("qwen3", {}),
    ("gemma2", {}),  # scaled embeddings, sandwich norms, sliding windows
    ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32}),  # the vector is after project_out
])
def test_other_families_embed_as_transformers(tiny_models, family, overrides):
    path = tiny_models(family, **overrides)
    llm, hf_model = engine(path), load_hf(path)
    try:
        for prompt, output in zip(PROMPTS, llm.embed(PROMPTS, PoolingParams(pooling_type="mean"), use_tqdm=False)):
            with torch.inference_mode():
                hidden = hf_model.model(torch.tensor([prompt])).last_hidden_state[0]
            assert_close(output.outputs.embedding, torch.nn.functional.normalize(hidden.mean(0), dim=0))
    finally:
        llm.llm_engine.shutdown()


def test_two_tensor_parallel_workers_embed_like_one(tiny_llama, llm):
    """After the final norm every rank holds the whole hidden state; the driver pools it."""
    params = PoolingParams(pooling_type="mean", normalize=False)
    reference = llm.embed(PROMPTS, params, use_tqdm=False)
    parallel = LLM(str(tiny_llama), max_model_len=256, num_gpu_blocks=64, int8_activations="off",
                   max_num_batched_tokens=CHUNK, max_num_seqs=8, tensor_parallel_size=2)
    try:
        for ours, ref in zip(parallel.embed(PROMPTS, params, use_tqdm=False), reference):
            assert_close(ours.outputs.embedding, torch.tensor(ref.outputs.embedding))
        assert parallel.llm_engine.get_stats().num_free_blocks == 64
    finally:
        parallel.llm_engine.shutdown()


@pytest.mark.parametrize("flag, value, pooling", [
    ("task", "embed", True), ("task", "embedding", True), ("task", "generate", False), ("runner", "pooling", True),
    ("runner", "auto", False), ("convert", "embed", True), ("convert", "none", False), ("task", None, False),
])
def test_vllm_task_runner_and_convert_values_that_ask_for_embeddings(flag, value, pooling):
    assert pooling_asked(flag, value) is pooling


@pytest.mark.parametrize("flag, value", [("task", "classify"), ("runner", "draft"), ("convert", "reward")])
def test_pooling_tasks_not_built_are_refused_naming_the_flag(flag, value):
    with pytest.raises(ValueError, match=f"--{flag} {value} is not supported here"):
        pooling_asked(flag, value)
