"""Every native GGUF type, in files written with random blocks (tests/gguf_writer.py), computed
from its blocks as stored (`quant.GGUFLinear`; F16/BF16 kept 16-bit, `HalfLinear`) and
checked against transformers, which dequantizes the same file (an independent reader): logits
close, greedy tokens identical. No float32 copy of a quantized weight is kept, and the process
grows by about the file's size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.attention.reference import ReferenceAttentionBackend
from pagedllm.model import load_model
from pagedllm.model.quant import GGUFLinear, HalfLinear, method_layers
from pagedllm.transformers_utils import resolve_model
from tests.gguf_writer import tokenizer_fields, write_random_llama
from tests.helpers import hf_greedy
from tests.test_model import PagedSequences, _hf_logits

CPU = torch.device("cpu")
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "F16", "BF16"]
# llama.cpp's Q4_K_M mixes types within a layer (v and down in Q6_K); here k in Q8_0 too, so the
# fused q/k/v projection has three parts of three types, and the head is its own Q6_K tensor.
MIXED = {"default": "Q4_K", "attn_k": "Q8_0", "attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K",
         "output": "Q6_K", "attn_output": "Q5_0"}
VOCAB = 512


def _prompts(count: int = 2, length: int = 12) -> list[list[int]]:
    gen = torch.Generator().manual_seed(count)
    return [torch.randint(3, VOCAB, (length + i,), generator=gen).tolist() for i in range(count)]


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def _load(path: Path):
    return load_model(resolve_model(str(path)), 256, ReferenceAttentionBackend(), torch.float32, CPU)


@pytest.fixture(autouse=True)
def _no_weight_cache(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_MODEL_CACHE", "0")


def _assert_no_float_copy(model, qtype: str) -> None:
    """Every projection and the table in the file's form; no 2-D float32 tensor at all."""
    kind = HalfLinear if qtype in ("F16", "BF16") else GGUFLinear
    for name, layer in method_layers(model).items():
        assert isinstance(layer.quant_method, kind), name
        if kind is GGUFLinear:
            assert layer.weight.dtype == torch.uint8 and set(layer.quant_method.qtypes) <= set(MIXED.values()) | {qtype}
    assert not [n for n, p in model.named_parameters() if p.dim() >= 2 and p.dtype == torch.float32]


@pytest.mark.parametrize("qtype", TYPES)
def test_every_type_computes_from_its_blocks_like_transformers(tmp_path, qtype):
    path = write_random_llama(tmp_path / f"{qtype}.gguf", {"default": qtype}, tied=qtype != "Q8_0")
    model, hf = _load(path), _hf(path)
    _assert_no_float_copy(model, qtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes <= 1.02 * path.stat().st_size  # the blocks as stored, every type
    prompts = _prompts()
    paged = PagedSequences(model, block_size=4)
    for prompt, logits in zip(prompts, paged.run(prompts)):
        torch.testing.assert_close(logits, _hf_logits(hf, prompt), atol=1e-3, rtol=1e-4)
    sequences = [list(p) for p in prompts]  # (their prompts are in the paged cache already)
    tokens: list[list[int]] = [[] for _ in prompts]
    last = [int(_hf_logits(hf, p)[-1].argmax()) for p in prompts]  # step 0 checked above
    for _ in range(6):
        for seq, toks, t in zip(sequences, tokens, last):
            seq.append(t)
            toks.append(t)
        rows = paged.run([[s[-1]] for s in sequences])
        last = [int(r[-1].argmax()) for r in rows]
    assert tokens == [hf_greedy(hf, p, 6, ignore_eos=True) for p in prompts]


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory) -> Path:
    """A Q4_K_M-like file with the default model's tokenizer (the engine builds one from it)."""
    fields = tokenizer_fields(resolve_model(None).path)
    return write_random_llama(tmp_path_factory.mktemp("mixed") / "q4_k_m-like.gguf", MIXED, tied=False,
                              vocab=len(fields["tokenizer.ggml.tokens"]), tokenizer=fields)


def test_a_q4_k_m_like_mix_serves_like_transformers_through_the_fused_decoder(mixed_file):
    """Mixed types in one fused projection (q in Q4_K, k in Q8_0, v in Q6_K: three packed parts)
    and an untied Q6_K head, through the engine: the fused C++ decoder runs the decode steps
    (every type through `gguf_matmul`) and its tokens are transformers' greedy ones (on float32
    activations, as every comparison with transformers runs)."""
    llm = LLM(str(mixed_file), max_model_len=128, num_gpu_blocks=64, int8_activations="off")
    model = llm.llm_engine.executor.worker.model
    assert [p.qtype for p in model.model.layers[0].self_attn.qkv_proj.quant_method.parts] == ["Q4_K", "Q8_0", "Q6_K"]
    assert model.lm_head.quant_method.qtypes == ["Q6_K"] and model.fused_layers is not None
    hf = _hf(mixed_file)
    prompts = _prompts(3, 9)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert got == [hf_greedy(hf, p, 8, ignore_eos=True) for p in prompts]
    # The fused loop's output is the Python loop's, bit for bit, with the parts of three types.
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, logprobs=3)
    run = lambda: [(o.outputs[0].token_ids, o.outputs[0].logprobs)  # noqa: E731
                   for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sampled, use_tqdm=False)]
    fused = run()
    fused_layers, model.fused_layers = model.fused_layers, None
    try:
        assert run() == fused
    finally:
        model.fused_layers = fused_layers


def test_the_weight_cache_stores_the_packed_blocks(mixed_file, tmp_path, monkeypatch):
    """A cached entry is about the GGUF's size (not float32's 7x), and a warm start from it
    computes the same logits."""
    monkeypatch.setenv("PAGEDLLM_MODEL_CACHE", "1")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    prompt = _prompts(1)[0]
    cold = PagedSequences(_load(mixed_file), block_size=4).run([prompt])[0]
    (weights,) = (tmp_path / "cache" / "weights").glob("*/weights.safetensors")
    assert weights.stat().st_size <= 1.1 * mixed_file.stat().st_size
    warm_model = _load(mixed_file)
    assert isinstance(warm_model.model.layers[1].mlp.down_proj.quant_method, GGUFLinear)
    assert torch.equal(PagedSequences(warm_model, block_size=4).run([prompt])[0], cold)


_GROWTH_SCRIPT = """
import json, sys, torch
from pagedllm.attention.reference import ReferenceAttentionBackend
from pagedllm.model import load_model
from pagedllm.model.memory import process_rss
from pagedllm.transformers_utils import resolve_model
source = resolve_model(sys.argv[1])
before = process_rss()
model = load_model(source, 256, ReferenceAttentionBackend(), torch.float32, torch.device("cpu"))
print(json.dumps({"growth": process_rss() - before}))
"""


def test_loading_grows_the_process_by_about_the_file(tmp_path):
    """In a fresh process, loading a ~110 MB Q4_K/Q6_K file (float32: ~0.8 GiB) grows the resident
    memory by at most 1.3x the file plus 0.4 GiB."""
    path = write_random_llama(tmp_path / "big.gguf", {"default": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K",
                                                    "token_embd": "Q6_K"},
                              hidden=2048, intermediate=5632, layers=4, heads=16, kv_heads=4, vocab=8192)
    size = path.stat().st_size
    env = {"PAGEDLLM_MODEL_CACHE": "0", "PYTHONPATH": str(Path(__file__).parent.parent), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", _GROWTH_SCRIPT, str(path)], capture_output=True, text=True, env=env,
                         check=True)
    growth = json.loads(out.stdout.strip().splitlines()[-1])["growth"]
    assert growth <= 1.3 * size + 0.4 * 2**30, (growth, size)
