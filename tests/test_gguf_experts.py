"""A mixture's experts in a quantized GGUF file keep their blocks (`quant.experts.GGUFExperts`):
the experts' parameters are the file's bytes, not a float32 copy (7x the file), each expert's
products run on the GGUF kernels, and the model's greedy tokens are transformers' on the same
file; the weight cache stores and restores the packed experts."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from pagedllm.attention.reference import ReferenceAttentionBackend
from pagedllm.model import load_model, weight_cache
from pagedllm.model.moe import Experts
from pagedllm.model.quant.experts import FloatExperts, GGUFExperts
from pagedllm.transformers_utils import resolve_model
from tests.gguf_writer import write_gguf
from tests.helpers import hf_greedy, random_prompts
from tests.test_model import PagedSequences

CPU = torch.device("cpu")
# Every projection's columns a multiple of 32, so every expert stack is quantized (the tiny
# Qwen3-MoE's default moe_intermediate_size, 48, would leave down in float32).
QWEN3_MOE = {"moe_intermediate_size": 64}
STEPS = 6


def _load(path: Path):
    return load_model(resolve_model(str(path)), 256, ReferenceAttentionBackend(), torch.float32, CPU)


def _experts(model) -> list[Experts]:
    return [m for m in model.modules() if isinstance(m, Experts)]


def _file_expert_bytes(path: Path) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors if "_exps" in t.name)


def paged_greedy(model, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy continuations of the prompts, decoded together through a paged cache."""
    paged = PagedSequences(model, block_size=4)
    last = [int(logits[-1].argmax()) for logits in paged.run(prompts)]
    tokens = [[t] for t in last]
    for _ in range(steps - 1):
        last = [int(logits[-1].argmax()) for logits in paged.run([[t] for t in last])]
        for toks, t in zip(tokens, last):
            toks.append(t)
    return tokens


@pytest.fixture(autouse=True)
def _no_weight_cache(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_MODEL_CACHE", "0")


def _assert_packed_experts(model, path: Path, qtype: str) -> None:
    """Every layer's experts in GGUF blocks of `qtype`, as flat bytes about the file's expert
    tensors' size (the blocks as stored); no
    3-D (stacked float) parameter left."""
    experts = _experts(model)
    assert experts and all(isinstance(e.experts_method, GGUFExperts) for e in experts)
    for e in experts:
        method = e.experts_method
        assert {p.qtype for m in method.gate_ups + method.downs for p in m.parts} == {qtype}
        assert e.gate_up_proj.dtype == torch.uint8 and e.down_proj.dtype == torch.uint8
    assert not [n for n, p in model.named_parameters() if p.dim() == 3]
    held = sum(p.numel() for e in experts for p in (e.gate_up_proj, e.down_proj))
    in_file = _file_expert_bytes(path)
    assert held == in_file, (held, in_file)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_quantized_qwen3_moe_experts_keep_their_blocks_and_decode_like_transformers(tiny_models, tmp_path, qtype):
    from transformers import AutoModelForCausalLM

    path = write_gguf(tiny_models("qwen3_moe", **QWEN3_MOE), "qwen3_moe", tmp_path / f"{qtype}.gguf",
                      qtype=getattr(gguf.GGMLQuantizationType, qtype))
    model = _load(path)
    _assert_packed_experts(model, path, qtype)
    # (transformers' GGUF reader does not map qwen3moe.expert_feed_forward_length: given here)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32,
                                              moe_intermediate_size=QWEN3_MOE["moe_intermediate_size"]).eval()
    prompts = random_prompts(3, [11, 17, 24], seed=4)
    assert paged_greedy(model, prompts, STEPS) == [hf_greedy(hf, p, STEPS, ignore_eos=True) for p in prompts]


def test_packed_mixtral_experts_compute_what_their_dequantized_floats_do(tiny_models, tmp_path):
    """(transformers reads no Mixtral GGUF: the oracle is the same experts dequantized back
    into float stacks, `FloatExperts`.)"""
    path = write_gguf(tiny_models("mixtral"), "mixtral", tmp_path / "q4_0.gguf", qtype=gguf.GGMLQuantizationType.Q4_0)
    packed = _load(path)
    _assert_packed_experts(packed, path, "Q4_0")
    floats = _load(path)
    for experts in _experts(floats):
        method = experts.experts_method
        gate_up, down = (torch.stack([m.to_float(None) for m in methods]) for methods in (method.gate_ups, method.downs))
        experts.install(FloatExperts(), gate_up, down)
    prompts = random_prompts(2, [13, 20], seed=6)
    ours, theirs = PagedSequences(packed, block_size=4).run(prompts), PagedSequences(floats, block_size=4).run(prompts)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert paged_greedy(packed, prompts, STEPS) == paged_greedy(floats, prompts, STEPS)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_the_weight_cache_stores_and_restores_packed_experts(tiny_models, tmp_path, monkeypatch, qtype):
    """The entry is about the file's size (the experts' blocks, not float32), and a warm start
    maps the packed experts back and decodes the same tokens."""
    monkeypatch.setenv("PAGEDLLM_MODEL_CACHE", "1")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tiny_models("qwen3_moe", **QWEN3_MOE), "qwen3_moe", tmp_path / f"{qtype}.gguf",
                      qtype=getattr(gguf.GGMLQuantizationType, qtype))
    prompts = random_prompts(2, [12, 19], seed=8)
    cold = paged_greedy(_load(path), prompts, STEPS)
    (weights,) = (tmp_path / "cache" / "weights").glob("*/weights.safetensors")
    assert weights.stat().st_size <= 1.1 * path.stat().st_size
    warm = _load(path)
    _assert_packed_experts(warm, path, qtype)
    spans = weight_cache.cache_file_mappings()
    for experts in _experts(warm):  # mapped from the entry, not read from the file again
        assert any(lo <= experts.gate_up_proj.data_ptr() < hi for lo, hi, _ in spans)
    assert paged_greedy(warm, prompts, STEPS) == cold


def test_packed_experts_split_over_two_workers_like_one(tiny_models, tmp_path):
    """tp=2 gives each rank 32 of the 64 intermediate columns: whole Q4_0 blocks of down's rows,
    so each rank keeps its slice packed (as a dense layer's), and decodes one worker's tokens."""
    from pagedllm import LLM, SamplingParams
    from tests.gguf_writer import tokenizer_fields

    path = write_gguf(tiny_models("qwen3_moe", **QWEN3_MOE), "qwen3_moe", tmp_path / "q4_0.gguf",
                      tokenizer=tokenizer_fields(resolve_model(None).path), qtype=gguf.GGMLQuantizationType.Q4_0)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, [5, 17, 26], seed=52)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # on float32 activations (not the GGUF default's int8 ones), as every comparison of outputs runs
    kwargs = dict(max_model_len=128, num_gpu_blocks=64, int8_activations="off")
    reference = [o.outputs[0].token_ids for o in LLM(str(path), **kwargs).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(path), **kwargs, tensor_parallel_size=2)
    try:
        experts = _experts(llm.llm_engine.executor.worker.model)
        assert all(isinstance(e.experts_method, GGUFExperts) and e.per_rank == 32 for e in experts)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == reference
    finally:
        llm.llm_engine.shutdown()
