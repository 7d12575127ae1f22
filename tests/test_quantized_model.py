"""The default model (SmolLM2-135M, Q4_1 with a Q8_0 table) on the GGUF kernels: its blocks kept
as the file stores them, its products against the dequantized weights, and the engine option
`int8_activations` end to end. (The kernels themselves, every type and path, against gguf-py's
dequantization: tests/test_gguf_kernels.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.kernels import gguf
from pagedllm.kernels.gguf import MAX_ROWS
from pagedllm.model.quant import EVERY_SIZE
from pagedllm.model import layers
from pagedllm.model import quant as quantization
from pagedllm.model.quant import GGUFLinear, int8_trial, layer_of


def test_the_default_model_keeps_its_quantized_blocks_as_the_file_stores_them(smollm_llm):
    """Every projection and the tied table stay GGUF-packed (no float copy, no unpacked copy: the
    file's bytes), and the packed products agree with the dequantized weights (and q/k row order)."""
    from gguf import GGUFReader

    from pagedllm.transformers_utils import resolve_model

    model = smollm_llm.llm_engine.executor.worker.model
    layer = {name: layer_of(model, w) for name, w in model.layer_projections(0).items()}
    qkv = layer["qkv_proj"].quant_method
    assert isinstance(qkv, GGUFLinear) and qkv.qtypes == ["Q4_1"]
    assert qkv.out_features == 576 + 2 * 192
    assert layer["gate_up_proj"].quant_method.out_features == 2 * 1536
    assert layer["down_proj"].quant_method.in_features == 1536
    assert model.lm_head.quant_method.qtypes == ["Q8_0"]  # the tied embedding table
    assert model.lm_head.quant_method is model.model.embed_tokens.quant_method
    stored = {t.name: int(t.n_bytes) for t in GGUFReader(resolve_model(None).path).tensors}
    assert layer["down_proj"].weight.numel() == stored["blk.0.ffn_down.weight"]
    assert model.lm_head.weight.numel() == stored["token_embd.weight"]
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    for module in (layer["qkv_proj"], layer["gate_up_proj"], model.lm_head):
        assert module.weight.dtype == torch.uint8 and module.weight.dim() == 1  # the packed bytes only
        dense = module.quant_method.to_float(module)
        torch.testing.assert_close(module.quant_method.apply(module, x), x @ dense.T, atol=5e-4, rtol=1e-4)


def test_packed_weights_refuse_activations_they_cannot_multiply(smollm_llm):
    model = smollm_llm.llm_engine.executor.worker.model
    with pytest.raises(TypeError, match="float32 CPU activations"):
        model.lm_head.quant_method.apply(model.lm_head, torch.zeros(1, 576, dtype=torch.bfloat16))


def test_the_trial_times_a_projection_past_l2_and_reports_its_rows():
    out_features, in_features = int8_trial.TRIAL_SHAPE
    # more than 2 MiB of Q4_K blocks (a core's L2 here): a weight that fits misjudges int8
    assert out_features * in_features * 144 // 256 > 2 << 20
    rows = int8_trial.measure("Q4_K")
    assert rows == 0 or rows in int8_trial.TRIAL_ROWS[:-1] or rows == quantization.EVERY_SIZE
    first = int8_trial.int8_rows_that_pay("Q4_K")  # measured, or read from the cache folder
    assert int8_trial.int8_rows_that_pay("Q4_K") == first  # then once per process


def test_auto_takes_int8_at_every_size_where_the_trial_says_so_and_on_up_to_max_rows(monkeypatch):
    """Where int8 wins at the largest trial size (AMX-INT8 tiles), a weight takes int8 activations
    at every size (prompts too), Q4_1 and Q8_0 as every other type; a trial that stops at 16 rows
    stops there; "on" takes them up to MAX_ROWS whatever the trial says."""
    methods = [GGUFLinear(parts=[SimpleNamespace(qtype=q, in_features=2048)]) for q in ("Q4_K", "Q4_1", "Q8_0")]
    monkeypatch.setattr(layers, "_linear_layers", lambda model: [SimpleNamespace(quant_method=m) for m in methods])
    monkeypatch.setattr(layers, "int8_rows_that_pay", lambda qtype: quantization.EVERY_SIZE)
    monkeypatch.setattr(layers, "set_ways_for_width", lambda qtype, in_features: EVERY_SIZE)
    assert layers.use_int8_activations(None, "auto") == 3
    assert [m.int8_rows for m in methods] == [quantization.EVERY_SIZE] * 3
    monkeypatch.setattr(layers, "int8_rows_that_pay", lambda qtype: 16 if qtype == "Q4_K" else 0)
    assert layers.use_int8_activations(None, "auto") == 1
    assert [m.int8_rows for m in methods] == [16, 0, 0]
    layers.use_int8_activations(None, "on")
    assert [m.int8_rows for m in methods] == [MAX_ROWS] * 3


@pytest.mark.slow
def test_the_default_model_on_int8_activations_stays_close_to_float32(smollm_llm, monkeypatch):
    """Greedy continuations on int8 activations against the float32 engine's (equal to
    transformers', tests/test_correctness.py): the same first token for every prompt, and
    long shared prefixes; and the int8 kernels are what ran. (They do not stay equal as long as
    bfloat16's do: `pagedllm bench dtype --dtypes float32 bfloat16 float32+int8`.)
    `smollm_llm` runs on float32 activations (int8_activations="off")."""
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    prompts = ["The capital of France is", "Water boils at", "The three primary colors are", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = smollm_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2),
                                  use_tqdm=False)
    reference = [o.outputs[0].token_ids for o in outputs]
    # float32's lead of its first token over the next (nats): where it is small, 8-bit
    # activations may pick the other ("Water boils at": 0.23 on an AVX2 machine, where int8
    # chose the second; its integer sums equal x quantized per block times W exactly).
    margins = []
    for o in outputs:
        top = sorted((lp.logprob for lp in o.outputs[0].logprobs[0].values()), reverse=True)
        margins.append(top[0] - top[1])
    llm = LLM(int8_activations="on", max_model_len=256, kv_cache_memory=64 << 20)
    try:
        model = llm.llm_engine.executor.worker.model
        assert layer_of(model, model.layer_projections(0)["down_proj"]).quant_method.int8_rows == MAX_ROWS
        calls = []
        original = gguf.matmul
        monkeypatch.setattr(gguf, "matmul", lambda x, w, int8=False: calls.append(int8) or original(x, w, int8=int8))
        # (prompts run the Python layer loop, decode steps the fused C++ one, which calls the C
        # side directly: the prompts' products show the flag)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert True in calls
    finally:
        llm.llm_engine.shutdown()
    shared = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for r, g in zip(reference, got)]
    clear = [s for s, margin in zip(shared, margins) if margin > 0.5]
    assert len(clear) >= 2 and min(clear) >= 1 and sum(shared) / len(shared) >= 4, (shared, margins)
