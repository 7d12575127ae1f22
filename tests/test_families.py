"""The model families against transformers, on tiny random models of each (tests/helpers.py):
paged logits within 1e-4 of transformers' forward (prompts in chunks that cross block edges and
windows, two sequences per batch, then decodes), greedy tokens identical to its `generate`
through the engine (chunked prompts, preemption by swap and by recompute, prefix-cache hits),
the same weights written as GGUF the way llama.cpp writes each architecture, and parameter
counts."""

from __future__ import annotations

import gguf
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.kv_spec import AttentionSpec, kv_cache_groups, max_blocks_of_sequence
from pagedllm.attention.reference import ReferenceAttentionBackend
from pagedllm.model import MODELS, load_model
from pagedllm.transformers_utils import SUPPORTED_ARCHITECTURES, load_arch_config, resolve_model
from tests.gguf_writer import write_gguf
from tests.helpers import FAMILY_ARCHS, hf_greedy, load_hf, random_prompts
from tests.test_model import PagedSequences, _hf_logits

CPU = torch.device("cpu")
LONGROPE = {"rope_scaling": {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                             "long_factor": [1.0 + 0.5 * i for i in range(8)]},
            "original_max_position_embeddings": 32, "max_position_embeddings": 256}

# id -> (family, config overrides): every family's default tiny shape and its variants.
CASES = {
    "qwen3": ("qwen3", {}),
    "qwen3-window": ("qwen3", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    "qwen3-yarn": ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                 "original_max_position_embeddings": 16}}),
    "qwen3-tied-bias": ("qwen3", {"tie_word_embeddings": True, "attention_bias": True}),
    "qwen3-moe": ("qwen3_moe", {}),
    "qwen3-moe-dense-layer": ("qwen3_moe", {"mlp_only_layers": [1], "norm_topk_prob": False}),
    "qwen3-moe-sparse-step": ("qwen3_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 3}),
    "mixtral": ("mixtral", {}),
    "mixtral-window-mqa": ("mixtral", {"sliding_window": 6, "num_key_value_heads": 1}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    "phi3": ("phi3", {}),
    "phi3-partial-rotary": ("phi3", {"partial_rotary_factor": 0.5}),
    "phi3-window": ("phi3", {"sliding_window": 7}),
    "phi3-longrope": ("phi3", LONGROPE),
    "opt": ("opt", {}),
    "opt-350m-shape": ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32}),
    "opt-no-bias-no-affine": ("opt", {"enable_bias": False, "layer_norm_elementwise_affine": False}),
    "granite": ("granite", {}),
    "granite-tied-bias": ("granite", {"tie_word_embeddings": True, "attention_bias": True}),
}
# The same weights as GGUF: the variants a GGUF file can express (llama.cpp's Gemma assumes
# query_pre_attn_scalar = head_dim and Gemma 3 five sliding layers to one global).
GGUF_CASES = {
    "qwen3": ("qwen3", {}),
    "qwen3-moe": ("qwen3_moe", {}),
    "mixtral": ("mixtral", {}),
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 32}),
    "gemma3": ("gemma3", {"sliding_window_pattern": 6, "num_hidden_layers": 6}),
    "phi3": ("phi3", {}),
    "phi3-partial-rotary": ("phi3", {"partial_rotary_factor": 0.5}),
    "phi3-longrope": ("phi3", LONGROPE),
    "granite": ("granite", {}),
}


def _load(source_path: str):
    return load_model(resolve_model(source_path), 256, ReferenceAttentionBackend(), torch.float32, CPU)


def _assert_paged_matches(model, hf, seed: int = 5) -> None:
    """Two prompts (30 and 21 tokens) prefilled together in two chunks each, through blocks of
    4 handed out shuffled, then three decode steps together: each row's logits within 1e-4 of
    transformers' over the whole sequence."""
    prompts = random_prompts(2, [30, 21], seed=seed)
    paged = PagedSequences(model, block_size=4)
    first = paged.run([prompts[0][:13], prompts[1][:9]])
    second = paged.run([prompts[0][13:], prompts[1][9:]])
    for prompt, a, b in zip(prompts, first, second):
        torch.testing.assert_close(torch.cat([a, b]), _hf_logits(hf, prompt), atol=1e-4, rtol=0)
    sequences, logits = [list(p) for p in prompts], second
    for _ in range(3):
        for seq, rows in zip(sequences, logits):
            seq.append(int(rows[-1].argmax()))
        logits = paged.run([[seq[-1]] for seq in sequences])
        for seq, rows in zip(sequences, logits):
            torch.testing.assert_close(rows[-1], _hf_logits(hf, seq)[-1], atol=1e-4, rtol=0)


def test_every_supported_architecture_has_a_class_and_every_family_a_tiny_model():
    assert tuple(MODELS) == SUPPORTED_ARCHITECTURES
    assert {arch for arch, _ in CASES.values()} == set(FAMILY_ARCHS)


@pytest.mark.parametrize("case", CASES)
def test_paged_logits_match_transformers(tiny_models, case):
    family, overrides = CASES[case]
    path = tiny_models(family, **overrides)
    model = _load(str(path))
    if family == "phi3" and "rope_scaling" in overrides:
        _assert_longrope_matches(model, load_hf(path))
        return
    _assert_paged_matches(model, load_hf(path))


def _assert_longrope_matches(model, hf) -> None:
    """LongRoPE picks its frequencies by the sequence's length at each step, as transformers
    does: a prompt within the pretraining length (32) gets the short set through its decodes,
    one past it the long set; each is computed whole (a chunk before the switch keeps the short
    set, where transformers' Phi-3 would re-encode the cache)."""
    for length in (20, 40):
        prompt = random_prompts(1, [length], seed=length)[0]
        paged = PagedSequences(model, block_size=4)
        logits = paged.run([prompt])[0]
        torch.testing.assert_close(logits, _hf_logits(hf, prompt), atol=1e-4, rtol=0)
        sequence = list(prompt)
        for _ in range(3):
            sequence.append(int(logits[-1].argmax()))
            logits = paged.run([[sequence[-1]]])[0]
            torch.testing.assert_close(logits[-1], _hf_logits(hf, sequence)[-1], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def engine_prompts():
    """Prompts of 3 to 41 tokens (crossing blocks of 4 and the tiny models' windows), the last
    two sharing their first 16 tokens (a prefix-cache hit within one pass)."""
    prompts = random_prompts(6, [3, 9, 17, 30, 41, 5], seed=3)
    prompts[5] = prompts[4][:16] + prompts[5]
    return prompts


@pytest.mark.parametrize("preemption_mode", ["swap", "recompute"])
@pytest.mark.parametrize("family", FAMILY_ARCHS)
def test_engine_greedy_matches_transformers(tiny_models, engine_prompts, family, preemption_mode):
    """Chunked prompts (16 tokens a step), a KV cache too small for every sequence at once
    (preempted by `preemption_mode`), prefix caching on; then the same prompts again, from the
    prefix cache."""
    path = tiny_models(family)
    hf = load_hf(path)
    expected = [hf_greedy(hf, p, 16, ignore_eos=True) for p in engine_prompts]
    # 40 blocks; a hybrid of windowed and full layers (several KV cache groups, each sequence
    # holding blocks in each, windowed ones given back as the window moves) gets just what one
    # sequence of max_model_len needs, so that these prompts still preempt each other.
    arch = load_arch_config(resolve_model(str(path)))
    groups = kv_cache_groups([AttentionSpec(1, 1, arch.layer_sliding_window(i)) for i in range(arch.num_layers)])
    num_blocks = 40 if len(groups) == 1 else max_blocks_of_sequence([g.sliding_window for g in groups], 128, 4, 16)
    llm = LLM(str(path), max_model_len=128, block_size=4, num_gpu_blocks=num_blocks, max_num_batched_tokens=16,
              max_num_seqs=6, enable_prefix_caching=True, preemption_mode=preemption_mode, swap_space=0.01,
              int8_activations="off")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(engine_prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.llm_engine.get_stats()
    recomputed = stats.num_recompute_preemptions
    assert stats.num_preemptions > 0
    if preemption_mode == "recompute":
        assert recomputed == stats.num_preemptions
    else:  # (a victim still computing its prompt is recomputed in either mode)
        assert stats.num_swap_preemptions > 0
    hits = stats.prefix_cache_hits
    again = llm.generate(engine_prompts, params, use_tqdm=False)
    assert llm.llm_engine.get_stats().prefix_cache_hits > hits
    assert [o.outputs[0].token_ids for o in again] == expected


@pytest.mark.parametrize("case", GGUF_CASES)
def test_gguf_written_like_llama_cpp_matches_transformers(tiny_models, tmp_path, case, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_MODEL_CACHE", "0")
    family, overrides = GGUF_CASES[case]
    path = tiny_models(family, **overrides)
    model = _load(str(write_gguf(path, family, tmp_path / "model.gguf")))
    assert type(model) is MODELS[load_arch_config(resolve_model(str(path))).architecture]
    if family == "phi3" and "rope_scaling" in overrides:
        _assert_longrope_matches(model, load_hf(path))
    else:
        _assert_paged_matches(model, load_hf(path))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "phi3", "gemma2"])
def test_quantized_gguf_keeps_the_blocks_of_its_projections(tiny_models, tmp_path, family, monkeypatch):
    """Q8_0 projections keep their blocks for the quantized kernel (a fused checkpoint's too),
    stacked experts too where all three stacks are quantized (Mixtral's); the tiny Qwen3-MoE's
    down stack (48 columns, not whole blocks) stays float32, so its experts are all dequantized.
    The logits stay those of the model (most rows: the rounding may change a router's pick of
    experts for a token)."""
    from pagedllm.model.quant.experts import FloatExperts, GGUFExperts
    from pagedllm.model.quant import GGUFLinear, layer_of

    monkeypatch.setenv("PAGEDLLM_MODEL_CACHE", "0")
    path = tiny_models(family, **({"query_pre_attn_scalar": 32} if family == "gemma2" else {}))
    model = _load(str(write_gguf(path, family, tmp_path / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)))
    for layer in range(model.cfg.num_layers):
        for name, weight in model.layer_projections(layer).items():
            if name.startswith("experts"):
                method = model.model.layers[layer].mlp.experts.experts_method
                if family == "mixtral":
                    assert isinstance(method, GGUFExperts) and weight.dtype == torch.uint8
                else:
                    assert isinstance(method, FloatExperts) and weight.dim() == 3 and weight.dtype == torch.float32
            else:
                method = layer_of(model, weight).quant_method
                assert isinstance(method, GGUFLinear) and set(method.qtypes) == {"Q8_0"}, name
    prompt = random_prompts(1, [24], seed=9)[0]
    ours = PagedSequences(model, block_size=4).run([prompt])[0]
    cosine = torch.nn.functional.cosine_similarity(ours, _hf_logits(load_hf(path), prompt), dim=-1)
    assert cosine.median() > 0.99


@pytest.fixture(scope="module")
def default_tokenizer_fields():
    from tests.gguf_writer import tokenizer_fields

    return tokenizer_fields(resolve_model(None).path)


def test_a_gguf_qwen3_serves_like_transformers_and_stops_at_its_end_of_turn(tiny_models, tmp_path, engine_prompts,
                                                                             default_tokenizer_fields, monkeypatch):
    """A GGUF file with a real vocabulary runs through the engine with the tokenizer built from
    it; its stop ids are its EOS (here <|endoftext|>, 0) and Qwen's end of turn (<|im_end|>, 2),
    found by text in the vocabulary as llama.cpp finds them."""
    monkeypatch.setenv("PAGEDLLM_MODEL_CACHE", "0")
    path = tiny_models("qwen3", eos_token_id=0)
    file = write_gguf(path, "qwen3", tmp_path / "qwen3.gguf", tokenizer=default_tokenizer_fields)
    llm = LLM(str(file), max_model_len=128, num_gpu_blocks=64, int8_activations="off")
    assert llm.llm_engine.eos_token_ids == [0, 2]
    hf = load_hf(path)
    outputs = llm.generate(engine_prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p, 12, ignore_eos=True) for p in engine_prompts]


@pytest.mark.parametrize("case", CASES)
def test_parameter_counts_match_transformers(tiny_models, case):
    """num_total_parameters is transformers' count (a tied head once); num_parameters leaves
    out the experts a token does not run."""
    family, overrides = CASES[case]
    path = tiny_models(family, **overrides)
    cfg = load_arch_config(resolve_model(str(path)))
    assert cfg.num_total_parameters == load_hf(path).num_parameters()
    inactive = 0
    if cfg.moe is not None:
        per_expert = 3 * cfg.hidden_size * cfg.moe.intermediate_size
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
        inactive = moe_layers * (cfg.moe.num_experts - cfg.moe.num_experts_per_tok) * per_expert
    assert cfg.num_parameters == cfg.num_total_parameters - inactive


def test_each_family_says_which_tensor_parallel_sizes_split_it(tiny_models):
    """Experts split their intermediate dimension like the dense MLP (48 = moe_intermediate_size
    of the tiny Qwen3-MoE: 3 does not split its 4 heads, 8 not its 48)."""
    qwen3_moe = load_arch_config(resolve_model(str(tiny_models("qwen3_moe"))))
    assert qwen3_moe.valid_tensor_parallel_sizes() == [1, 2, 4]
    odd = load_arch_config(resolve_model(str(tiny_models("qwen3_moe", moe_intermediate_size=50))))
    assert odd.valid_tensor_parallel_sizes() == [1, 2]
    with pytest.raises(ValueError, match=r"moe_intermediate_size 50\); valid sizes: \[1, 2\]"):
        odd.check_tensor_parallel_size(4)


@pytest.mark.parametrize("family", ["qwen3", "mixtral"])
def test_bench_throughput_runs_on_the_family(tiny_models, tmp_path, capsys, family):
    """`pagedllm bench throughput` on a dense Qwen3 and a Mixtral (benchmarks/family_models.py
    builds larger ones): every request's tokens come out and the table is printed."""
    import json

    from pagedllm.bench.datasets import sample_requests
    from pagedllm.cli import main

    out = tmp_path / "bench.json"
    code = main(["bench", "throughput", str(tiny_models(family)), "--dataset", "alpaca", "--num-prompts", "4",
                 "--max-model-len", "128", "--output-json", str(out)])
    assert code == 0
    assert "output_tok_per_s" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["results"]
    assert row["output_tokens"] == sum(r.output_len for r in sample_requests("alpaca", 4, 128, 49152))


def test_models_that_wait_on_the_host_are_not_captured_as_cuda_graphs(tiny_models):
    """A mixture of experts counts its experts' tokens on the host: its decode steps run eagerly.
    Windowed and soft-capped attention are compile-time constants of the Triton kernels, so those
    models are captured."""
    for family, overrides in (("qwen3", {}), ("gemma2", {}), ("phi3", {"sliding_window": 7})):
        assert _load(str(tiny_models(family, **overrides))).supports_cuda_graphs, family
    for family in ("qwen3_moe", "mixtral"):
        assert not _load(str(tiny_models(family))).supports_cuda_graphs, family


def test_batch_invariant_mode_refuses_a_mixture_of_experts(tiny_models):
    with pytest.raises(ValueError, match="not supported for mixture-of-experts"):
        LLM(str(tiny_models("mixtral")), max_model_len=128, num_gpu_blocks=32, batch_invariant=True)


def test_older_mixtral_gguf_files_name_each_expert():
    """Files converted before llama.cpp stacked the experts hold one tensor per expert."""
    from pagedllm.model.mixtral import MixtralForCausalLM

    assert MixtralForCausalLM.gguf_to_hf_name("blk.3.ffn_up.5.weight") == "model.layers.3.mlp.experts.5.up_proj.weight"
    assert MixtralForCausalLM.gguf_to_hf_name("blk.3.ffn_gate_exps.weight") == "model.layers.3.mlp.experts.gate_proj.weight"


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_experts_stacked_in_one_tensor_load_like_one_per_expert(tiny_models, tmp_path, family):
    """transformers 5 holds each layer's experts stacked (`mlp.experts.gate_up_proj`
    [E, 2 I, H], `down_proj` [E, H, I]); a checkpoint saved in that form loads as the
    per-expert one does."""
    import shutil

    from safetensors.torch import save_file

    path = tiny_models(family)
    hf = load_hf(path)
    state = {name: t.contiguous() for name, t in hf.state_dict().items() if name != "lm_head.weight" or
             not hf.config.tie_word_embeddings}
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    shutil.copy(path / "config.json", tmp_path / "config.json")
    save_file(state, str(tmp_path / "model.safetensors"))
    _assert_paged_matches(_load(str(tmp_path)), hf)
