"""Matmuls from GGUF-quantized blocks on int8 activations (`int8_activations`): the kernel
against an oracle in torch that quantizes x the same way, and the engine option end to end."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import quant
from pagedllm.kernels.quant import MAX_ROWS, int8_matmul, quantized_matmul
from pagedllm.model.quant import KERNELS, layer_of
from tests.test_quant_matmul import _quantized


def _int8_oracle(x: torch.Tensor, matrix) -> torch.Tensor:
    """The kernel's arithmetic in float64 from the unpacked blocks: x quantized per block of 32
    (scale max|x| / 127, values rounded to nearest), then per block d dx sum(q qx), plus
    m dx sum(qx) for Q4_1's minimum: the minimum meets the rounded x, as llama.cpp's Q8_1 sum
    (with x's own sum the rounding error followed the uncentred d q: 2.4x llama.cpp's)."""
    u = matrix.unpack()
    rows = x.shape[0]
    blocks = x.view(rows, -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    qx = torch.round(blocks * torch.where(scale > 0, 1 / scale, torch.zeros_like(scale)))
    assert qx.abs().max() <= 127
    if matrix.qtype == "Q8_0":
        qw = u.values.view(torch.int8).view(matrix.out_features, -1, 32)
    else:  # nibbles: value j of a block in the low half of its byte j, value j + 16 in the high
        packed = u.values.view(matrix.out_features, -1, 16)
        qw = torch.cat([packed & 0x0F, packed >> 4], dim=-1)
    qw = qw.double()
    dots = torch.einsum("rbj,nbj->rnb", qx.double(), qw)  # integer sums, exact in float64
    y = (dots * u.scales.double()[None] * scale.double().squeeze(-1)[:, None]).sum(-1)
    if u.mins is not None:
        y += (qx.double() * scale.double()).sum(-1) @ u.mins.double().T
    return y


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])  # every row-group size, and groups plus a rest
@pytest.mark.parametrize("shape", [(96, 64), (130, 576)])
def test_int8_matmul_equals_the_product_of_the_quantized_activations(qtype, rows, shape):
    matrix, dense = _quantized(qtype, *shape, seed=rows)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    got = int8_matmul(x, matrix).double()
    torch.testing.assert_close(got, _int8_oracle(x, matrix), atol=2e-3, rtol=1e-4)
    # and it is near the float32 product: the activations' quantization error only
    exact = x.double() @ dense.double().T
    assert 1e-5 < (got - exact).norm() / exact.norm() < 0.02


def test_int8_rows_choose_the_kernel():
    matrix, dense = _quantized("Q4_1", 64, 96, seed=0)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1))
    float_path = quantized_matmul(x, matrix)
    torch.testing.assert_close(float_path, x @ dense.T, atol=2e-4, rtol=1e-5)  # int8_rows = 0: float
    matrix.int8_rows = 3
    assert torch.equal(quantized_matmul(x, matrix), int8_matmul(x, matrix))
    assert not torch.equal(quantized_matmul(x, matrix), float_path)
    matrix.int8_rows = 2  # 3 rows is past it: float again
    assert torch.equal(quantized_matmul(x, matrix), float_path)


def test_the_trial_reports_rows_and_the_instructions():
    rows = quant.int8_rows_that_pay()
    assert rows == 0 or rows in quant._TRIAL_ROWS
    isa = quant.int8_isa()
    flags = open("/proc/cpuinfo").read() if __import__("os").path.exists("/proc/cpuinfo") else ""
    if " avx512_vnni" in flags and " avx512vl" in flags:
        assert isa == "AVX512-VNNI VPDPBUSD"
    elif " avx_vnni" in flags:
        assert isa == "AVX-VNNI VPDPBUSD"
    elif " avx2" in flags and " fma" in flags:
        assert isa == "AVX2 VPMADDUBSW"


def test_the_gguf_trial_times_a_projection_past_l2_and_reports_its_rows():
    from pagedllm.model import quant as quantization
    from pagedllm.model.quant import int8_trial

    out_features, in_features = int8_trial.TRIAL_SHAPE
    # more than 2 MiB of Q4_K blocks (a core's L2 here): a weight that fits misjudges int8
    assert out_features * in_features * 144 // 256 > 2 << 20
    rows = int8_trial.measure("Q4_K")
    assert rows == 0 or rows in int8_trial.TRIAL_ROWS[:-1] or rows == quantization.EVERY_SIZE
    first = int8_trial.int8_rows_that_pay("Q4_K")  # measured, or read from the cache folder
    assert int8_trial.int8_rows_that_pay("Q4_K") == first  # then once per process


def test_auto_lets_the_gguf_kernels_take_int8_at_every_size_where_the_trial_says_so(monkeypatch):
    """Where int8 wins at the largest trial size (AMX-INT8 tiles), a weight on the GGUF kernels
    takes int8 activations at every size (prompts too); one on kernels/quant.py's stays within
    the rows its kernels serve (quant.MAX_ROWS); a trial that stops at 16 rows stops there."""
    from types import SimpleNamespace

    from pagedllm.model import layers
    from pagedllm.model import quant as quantization

    def method(qtype):
        return quantization.GGUFLinear(parts=[SimpleNamespace(qtype=qtype)])

    gguf_only, legacy = method("Q4_K"), method(next(iter(quant.TYPE_IDS)))
    monkeypatch.setattr(layers, "_linear_layers", lambda model: [SimpleNamespace(quant_method=m) for m in (gguf_only, legacy)])
    monkeypatch.setattr(layers, "int8_rows_that_pay", lambda qtype: quantization.EVERY_SIZE)
    assert layers.use_int8_activations(None, "auto") == 2
    assert gguf_only.int8_rows == quantization.EVERY_SIZE
    assert legacy.int8_rows == MAX_ROWS or quantization.kernels_for(legacy.qtypes[0]) == "gguf"
    monkeypatch.setattr(layers, "int8_rows_that_pay", lambda qtype: 16)
    layers.use_int8_activations(None, "auto")
    assert gguf_only.int8_rows == 16
    layers.use_int8_activations(None, "on")
    assert gguf_only.int8_rows == MAX_ROWS


def test_bad_modes_and_combinations_are_refused():
    from pagedllm.config import EngineArgs

    with pytest.raises(ValueError, match="int8_activations must be one of"):
        EngineArgs(int8_activations="yes").create_engine_config()
    for mode in ("auto", "on"):
        with pytest.raises(ValueError, match="do not combine"):
            EngineArgs(int8_activations=mode, batch_invariant=True).create_engine_config()


@pytest.mark.slow
def test_the_default_model_on_int8_activations_stays_close_to_float32(smollm_llm):
    """Greedy continuations on int8 activations against the float32 engine's (equal to
    transformers', tests/test_correctness.py): the same first token for every prompt, and
    long shared prefixes; and the int8 kernel is what ran. (They do not stay equal as long as
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
        originals = {kernels: kernels.matmul for kernels in KERNELS.values()}
        for kernels, original in originals.items():
            kernels.matmul = lambda x, w, int8=False, original=original: calls.append(int8) or original(x, w, int8=int8)
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            for kernels, original in originals.items():
                kernels.matmul = original
        assert True in calls
    finally:
        llm.llm_engine.shutdown()
    shared = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for r, g in zip(reference, got)]
    clear = [s for s, margin in zip(shared, margins) if margin > 0.5]
    assert len(clear) >= 2 and min(clear) >= 1 and sum(shared) / len(shared) >= 4, (shared, margins)
