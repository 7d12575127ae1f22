"""Batch-invariant mode: a request's tokens and log-probabilities are bitwise the same alone, in
batches of any size, with its prompt chunked, with its prefix from the cache, and after being
preempted (swapped or recomputed)."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kernels import onednn
from pagedllm.model import invariance
from pagedllm.model.quant import FloatLinear
from tests.helpers import random_prompts

# Contexts past 256 tokens, so they span several of the mode's fixed attention partitions.
TARGET_LENGTHS = [3, 17, 40, 130, 260, 301]
MAX_TOKENS = 16


def _params(i: int) -> SamplingParams:
    if i % 3 == 0:  # greedy ones among the sampled ones
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    return SamplingParams(temperature=1.0, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)


def _targets() -> list[list[int]]:
    return random_prompts(len(TARGET_LENGTHS), TARGET_LENGTHS, seed=1)


def _fingerprint(output) -> tuple:
    """Tokens and every log-probability reported for them, as exact floats."""
    completion = output.outputs[0]
    logprobs = [sorted((t, lp.logprob) for t, lp in step.items()) for step in completion.logprobs]
    return tuple(completion.token_ids), repr(logprobs)


# Two threads whatever the machine's default: kernels that share one row among threads (a lone
# sequence) and give rows a thread each (a batch) must sum in the same order; at one thread the
# difference never shows.
THREADS = 2


@pytest.fixture(autouse=True, scope="module")
def _keep_thread_count():
    previous = torch.get_num_threads()  # (the worker sets the process's count)
    yield
    torch.set_num_threads(previous)


def _llm(model, **kwargs) -> LLM:
    base = dict(max_model_len=512, batch_invariant=True, enable_prefix_caching=False, max_num_seqs=64,
                threads=THREADS)
    return LLM(str(model), **{**base, **kwargs})


@pytest.fixture(scope="module")
def alone(tiny_llama) -> list[tuple]:
    """Each target run by itself on an engine that holds nothing else."""
    llm = _llm(tiny_llama)
    return [_fingerprint(llm.generate([p], _params(i), use_tqdm=False)[0]) for i, p in enumerate(_targets())]


def _with_neighbours(llm: LLM, num_others: int = 12) -> list[tuple]:
    """The targets' fingerprints when they run among `num_others` other requests."""
    targets = _targets()
    others = random_prompts(num_others, [9, 60, 150, 33, 280], seed=2)
    other_params = [SamplingParams(temperature=0.8, seed=i, max_tokens=MAX_TOKENS + i % 7, ignore_eos=True)
                    for i in range(num_others)]
    target_params = [_params(i) for i in range(len(targets))]
    # Some neighbours first: the targets join a batch already running.
    prompts = others[:5] + targets + others[5:]
    params = other_params[:5] + target_params + other_params[5:]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [_fingerprint(o) for o in outputs[5 : 5 + len(targets)]]


def test_a_batch_of_any_size_changes_nothing(tiny_llama, alone):
    llm = _llm(tiny_llama)
    assert _with_neighbours(llm, num_others=24) == alone
    assert _with_neighbours(llm, num_others=5) == alone


def test_chunked_prompts_change_nothing(tiny_llama, alone):
    llm = _llm(tiny_llama, max_num_batched_tokens=64, max_num_seqs=32)
    assert _with_neighbours(llm) == alone


def test_a_prefix_from_the_cache_changes_nothing(tiny_llama, alone):
    llm = _llm(tiny_llama, enable_prefix_caching=True)
    # Warm the cache with each target's first blocks (and a different continuation).
    warm = [p[: len(p) // 16 * 16] + [7] * 5 for p in _targets() if len(p) >= 16]
    llm.generate(warm, SamplingParams(max_tokens=2), use_tqdm=False)
    outputs = llm.generate(_targets(), [_params(i) for i in range(len(TARGET_LENGTHS))], use_tqdm=False)
    assert llm.llm_engine.get_stats().prefix_cache_hits > 0
    assert [_fingerprint(o) for o in outputs] == alone


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_changes_nothing(tiny_llama, alone, mode):
    # 34 blocks of 16 tokens (one 512-token context needs 32) for a batch that wants far more.
    llm = _llm(tiny_llama, num_gpu_blocks=34, swap_space=0.05, preemption_mode=mode)
    assert _with_neighbours(llm, num_others=24) == alone
    stats = llm.llm_engine.get_stats()
    preemptions = stats.num_swap_preemptions if mode == "swap" else stats.num_recompute_preemptions
    assert preemptions > 0


def test_without_the_mode_chunking_does_change_the_logprobs(tiny_llama):
    """The control: the default mode's reduction orders depend on the batch (fresh prompts take
    torch's fused attention, chunks the kernel), so the same test sees a difference there."""
    targets = _targets()[-2:]
    params = [_params(1), _params(2)]
    whole = LLM(str(tiny_llama), max_model_len=512, enable_prefix_caching=False).generate(targets, params, use_tqdm=False)
    chunked = LLM(str(tiny_llama), max_model_len=512, enable_prefix_caching=False, max_num_batched_tokens=64,
                  max_num_seqs=32).generate(
        targets, params, use_tqdm=False)
    assert [_fingerprint(o) for o in whole] != [_fingerprint(o) for o in chunked]


def test_projections_fall_back_to_fixed_tiles_where_onednn_varies(tiny_llama, monkeypatch):
    """If oneDNN's products varied with the row count on some CPU, the mode would run them in
    tiles of one size; each row's result is then the same at every row count and position."""
    monkeypatch.setattr(invariance, "_row_invariant", lambda packed, in_features: False)
    llm = _llm(tiny_llama)
    head = llm.llm_engine.executor.worker.model.lm_head
    method = head.quant_method
    assert isinstance(method, FloatLinear) and method.row_tile == invariance.FIXED_ROW_TILE
    x = torch.randn(40, head.weight.shape[1], generator=torch.Generator().manual_seed(0))
    full = onednn.packed_linear(x, method.packed, None, method.row_tile)
    for rows, start in [(1, 0), (5, 3), (17, 9), (33, 7)]:
        part = onednn.packed_linear(x[start : start + rows], method.packed, None, method.row_tile)
        assert torch.equal(part, full[start : start + rows])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(attention_backend="reference"), "needs the cpu attention backend"),
        (dict(dtype="bfloat16"), "built for float32 on a CPU"),
    ],
)
def test_what_the_mode_cannot_do_is_refused_naming_the_fix(tiny_llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _llm(tiny_llama, **kwargs)
