"""The C++ layer loop (`pagedllm.model.fused_layers`) on every dense family's layer shape, from
GGUF files of tiny random models with Q8_0 projections (written as llama.cpp writes each
architecture, `tests/gguf_writer.py`): the decode steps through it give bitwise the Python
loop's sampled tokens and log-probabilities, and greedy decoding through it gives transformers'
tokens on the same weights (but past LongRoPE's switch, where the two differ by design) (the tiny model with each quantized tensor rounded through gguf-py's
Q8_0 quantize/dequantize, which is what the file holds)."""

from __future__ import annotations

import gguf
import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.gguf_writer import write_gguf
from tests.helpers import hf_greedy, load_hf, random_prompts
from tests.test_families import LONGROPE
from tests.test_fused_layers import _counting, _run, _without

Q8_0 = gguf.GGMLQuantizationType.Q8_0

# id -> (family, config overrides, what its layers add to Llama's)
CASES = {
    "qwen3": ("qwen3", {}),  # q/k head norms, head_dim of its own
    "qwen2-bias": ("qwen2", {}),  # q/k/v biases
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 32, "sliding_window": 8}),  # sandwich (1 + w) norms,
    # GELU-tanh, attention soft caps, windowed and global layers alternating
    # q/k (1 + w) norms, local and global layers with rotary tables of their own (five to one: what
    # llama.cpp's Gemma 3 assumes)
    "gemma3": ("gemma3", {"sliding_window_pattern": 6, "num_hidden_layers": 6, "sliding_window": 8}),
    "phi3-partial-rotary": ("phi3", {"partial_rotary_factor": 0.5}),  # half of each head turns
    "phi3-longrope": ("phi3", LONGROPE),  # table rows by sequence length (past 32 tokens: the long set)
    "granite": ("granite", {}),  # branch multipliers
    # Mixtures of experts over Q8_0 experts: routers Q8_0 (as written here) or F32 (as llama-quantize
    # keeps them)
    "mixtral": ("mixtral", {}),
    "qwen3-moe-float-router": ("qwen3_moe", {"moe_intermediate_size": 64}),
}
FLOAT_ROUTERS = {"qwen3-moe-float-router"}


@pytest.fixture(scope="module")
def tokenizer_fields():
    from pagedllm.transformers_utils import resolve_model
    from tests.gguf_writer import tokenizer_fields

    return tokenizer_fields(resolve_model(None).path)


def _quantized_oracle(path, float_routers: bool):
    """transformers' model of `path` with the tensors the file quantizes replaced by what the file
    holds: each rounded through Q8_0 (gguf-py's own quantize and dequantize)."""
    hf = load_hf(path)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            router = name.endswith((".gate.weight", "router.weight"))
            if param.dim() >= 2 and param.shape[-1] % 32 == 0 and "norm" not in name and not (router and float_routers):
                blocks = gguf.quants.quantize(param.numpy(), Q8_0)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, Q8_0)).reshape(param.shape))
    return hf


@pytest.mark.parametrize("case", CASES)
def test_each_familys_fused_step_is_the_layer_loop_bitwise_and_transformers_greedy(
        tiny_models, tmp_path, tokenizer_fields, case, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_MODEL_CACHE", "0")
    family, overrides = CASES[case]
    path = tiny_models(family, **overrides)
    file = write_gguf(path, family, tmp_path / "q8.gguf", tokenizer=tokenizer_fields, qtype=Q8_0,
                      float_routers=case in FLOAT_ROUTERS)
    # (no prefix caching: the second run would compute its prompts on cached blocks, not as the first)
    llm = LLM(str(file), max_model_len=256, num_gpu_blocks=128, int8_activations="off", enable_prefix_caching=False)
    try:
        model = llm.llm_engine.executor.worker.model
        assert model.fused_layers is not None, case
        moes = [layer.moe for layer in model.fused_layers.layers if layer.moe is not None]
        assert bool(moes) == (family in ("mixtral", "qwen3_moe"))  # (the experts in the C++ step too)
        assert all(m.gate.quant_method.dense == (case in FLOAT_ROUTERS) for m in moes)
        prompts = random_prompts(3, [30, 21, 9], seed=11)
        params = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True, logprobs=5)
        calls: list[int] = []
        with _counting(model.fused_layers, calls):
            fused = _run(llm, prompts, params)
            assert 3 in calls  # the three decoding together, through the C++ loop
            with _without(model):
                count = len(calls)
                loop = _run(llm, prompts, params)
                assert len(calls) == count
            assert fused == loop  # tokens and log-probabilities, floats compared with ==
            greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            ours = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            assert len(calls) > count + 10  # (its decodes went through the C++ loop too)
        if case == "phi3-longrope":
            return  # transformers re-encodes its whole cache once a sequence crosses 32 tokens; a paged
            # cache keeps its keys (model/rotary.py): their tokens part there by design
        oracle = _quantized_oracle(path, case in FLOAT_ROUTERS)
        assert ours == [hf_greedy(oracle, p, 12, ignore_eos=True) for p in prompts]
    finally:
        llm.llm_engine.shutdown()


def test_experts_take_int8_activations_as_the_other_products_and_stay_bitwise(tiny_models, tmp_path, tokenizer_fields,
                                                                             monkeypatch):
    """With int8 activations on, a mixture's GGUF experts take them too (as llama.cpp multiplies
    its experts), and the C++ step stays bitwise the loop on them."""
    from pagedllm.kernels.gguf import MAX_ROWS

    monkeypatch.setenv("PAGEDLLM_MODEL_CACHE", "0")
    path = tiny_models("mixtral")
    file = write_gguf(path, "mixtral", tmp_path / "q8.gguf", tokenizer=tokenizer_fields, qtype=Q8_0)
    llm = LLM(str(file), max_model_len=256, num_gpu_blocks=128, int8_activations="on", enable_prefix_caching=False)
    try:
        model = llm.llm_engine.executor.worker.model
        experts = [m.mlp.experts.experts_method for m in model.model.layers]
        assert all(e.int8_rows == MAX_ROWS for method in experts for e in (*method.gate_ups, *method.downs))
        prompts = random_prompts(3, [30, 21, 9], seed=3)
        params = SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True, logprobs=3)
        calls: list[int] = []
        with _counting(model.fused_layers, calls):
            fused = _run(llm, prompts, params)
            assert 3 in calls
            with _without(model):
                loop = _run(llm, prompts, params)
        assert fused == loop
    finally:
        llm.llm_engine.shutdown()


def test_longrope_rows_kept_while_short_switch_in_a_step_advanced_in_place(tiny_models, tmp_path, tokenizer_fields,
                                                                            monkeypatch):
    """While no sequence is past LongRoPE's switch, the rotary rows are the positions and the
    fused step keeps them (`FusedDecoderLayers.rows_limit`); a sequence crossing it in a step whose
    inputs were advanced in place (the switch at 40 tokens is inside a block: the tables do not
    change there) takes the long table's rows from that step on: greedy tokens and cumulative
    log-probabilities (compared with ==) those of the Python loop."""
    from tests.test_fused_layers import _tokens_and_logprobs

    monkeypatch.setenv("PAGEDLLM_MODEL_CACHE", "0")
    path = tiny_models("phi3", **{**LONGROPE, "original_max_position_embeddings": 40})
    file = write_gguf(path, "phi3", tmp_path / "q8.gguf", tokenizer=tokenizer_fields, qtype=Q8_0)
    llm = LLM(str(file), max_model_len=256, num_gpu_blocks=128, int8_activations="off", enable_prefix_caching=False)
    try:
        model = llm.llm_engine.executor.worker.model
        assert model.fused_layers.rows_limit == 40
        prompts = random_prompts(3, [30, 21, 9], seed=11)  # the first crosses 40 at its 11th token
        greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        calls: list[int] = []
        with _counting(model.fused_layers, calls):
            fused = _tokens_and_logprobs(llm.generate(prompts, greedy, use_tqdm=False))
        assert calls.count(3) >= 14  # the decode steps, through the C++ step
        with _without(model):
            assert _tokens_and_logprobs(llm.generate(prompts, greedy, use_tqdm=False)) == fused
    finally:
        llm.llm_engine.shutdown()


def test_longrope_rows_are_the_positions_until_a_sequence_passes_the_switch():
    """`table_positions`: the positions tensor itself while no sequence is longer than the
    pretraining length (a length equal to it is still short), the long table's rows for the
    sequences past it once one is."""
    from types import SimpleNamespace

    from pagedllm.model.rotary import RotaryEmbedding

    scaling = {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 8,
               "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    rotary = RotaryEmbedding(16, 64, 10000.0, scaling, torch.float32)

    def decodes(lengths):
        return SimpleNamespace(query_lens=[1] * len(lengths), num_decodes=len(lengths), seq_lens=torch.tensor(lengths),
                               max_seq_len=max(lengths))

    positions = torch.tensor([4, 7])
    assert rotary.table_positions(positions, decodes([5, 8])) is positions
    assert rotary.table_positions(positions + 1, decodes([6, 9])).tolist() == [5, 64 + 8]
