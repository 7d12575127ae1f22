"""Matmuls from GGUF-quantized blocks (Q4_1, Q8_0) against the dequantized float weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm.kernels import quant
from pagedllm.kernels.quant import MAX_ROWS, QuantizedMatrix, float_isa, quantized_matmul
from pagedllm.model.quant import GGUFLinear, layer_of


def _quantized(qtype: str, out_features: int, in_features: int, seed: int):
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((out_features, in_features)).astype(np.float32)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    blocks = gguf.quants.quantize(dense, kind)
    return QuantizedMatrix(qtype, torch.from_numpy(blocks), in_features), torch.from_numpy(gguf.quants.dequantize(blocks, kind))


def _cpu_has_amx_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False


@pytest.fixture(params=["amx", "no-amx"] if _cpu_has_amx_bf16() else ["no-amx"])
def amx_way(request):
    """Each test runs with the AMX way and without where the CPU has AMX; once elsewhere."""
    if request.param == "amx" and not quant.set_amx(True):
        pytest.skip("the CPU has AMX but Linux refused the tiles to this process")
    if request.param == "no-amx":
        quant.set_amx(False)
    yield request.param
    quant.set_amx(True)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
# AVX2: every row-group size of the few-rows way and a group plus a rest; the tiled way from 8
# rows: one 8-row panel (8), one 16-row panel part empty (11, 15) or full (16), a 16-row panel and
# an 8-row one (17, 24, 33), and past its 64-row blocks (137). AVX-512: the wide way's every group
# size (1-8), two groups of each split (9 = 5 + 4, 10, 11, 12, 13, 14, 15, 16 = 8 + 8), three
# (17, 24), five (33), eight (64); the tiled way from 65. AMX (from 10 rows): one 16-row tile of
# x part empty (10-15) or full (16), two (17, 24, 33), four (64), a second pass (65, 137).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 24, 33, MAX_ROWS,
                                  MAX_ROWS + 1, 2 * MAX_ROWS + 9])
# 130: the tiled way's last 12-row tile of W holds 10 rows, AMX's last 32 rows of W 2; 97: an odd
# row of W after the pairs
@pytest.mark.parametrize("shape", [(96, 64), (130, 576), (97, 64)])
def test_quantized_matmul_equals_the_dequantized_product(qtype, rows, shape, amx_way):
    matrix, dense = _quantized(qtype, *shape, seed=rows)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(quantized_matmul(x, matrix), x @ dense.T, atol=2e-4, rtol=1e-5)


@pytest.mark.skipif(not _cpu_has_amx_bf16(), reason="needs a CPU with AMX-BF16: this one checks the AMX way")
def test_the_amx_way_is_as_exact_as_float32():
    # Its operands are exact (q in one bfloat16, x in three) and its sums float32, so its error
    # against a float64 product stays within a few float32 roundings of sum |x w| (measured: at
    # most 1.4 of them; the AVX-512 way's 0.7). x carried in two parts instead (2^-17 of each
    # value lost, as the GGUF types' prompt products do) would be 17 over this data: the bound
    # below fails it, which the last assertion shows.
    assert quant.set_amx(True) and quant.amx_min_rows() == 10
    matrix, dense = _quantized("Q4_1", 256, 1536, seed=3)
    x = torch.randn(40, 1536, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 3, 1536)
    exact = x.double() @ dense.double().T
    bound = (x.double().abs() @ dense.double().abs().T) * 2.0**-24 * 4
    assert (quantized_matmul(x, matrix).double() - exact).abs().le(bound).all()
    hi = x.bfloat16().float()
    two_parts = hi + (x - hi).bfloat16().float()
    assert not (two_parts.double() @ dense.double().T - exact).abs().le(bound).all()


def _batches_of_the_same_way() -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """(first row, rows) of products that take one way, with one reduction order, on this build:
    the few-rows ways' and the AMX way's (from quant.amx_min_rows() rows on)."""
    amx = quant.amx_min_rows()
    few = ((0, 1), (2, 1), (0, 2), (3, 4), (1, 5), (4, 9), (0, 16)) if float_isa() != "AVX2" else ()
    batches = ((0, 8), (3, 8), (5, 17), (20, 28), (1, 40)) + few
    if not amx:
        return batches, ()
    return tuple(b for b in batches if b[1] < amx), tuple(b for b in batches if b[1] >= amx)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_a_row_gets_the_same_result_in_any_batch_of_one_way(qtype, amx_way):
    # Each output is one FMA chain (or, on AMX, one tile element's sum and its scaling) over the
    # inputs in an order that does not depend on the other rows: the same bits whether a row
    # shares its product with 7 rows or 40, at any position (AVX2: from 8 rows on, the tiled way;
    # AVX-512: 1 to 64 rows, the wide way; AMX: from 10 rows on; portable: all).
    matrix, _ = _quantized(qtype, 131, 576, seed=1)
    x = torch.randn(48, 576, generator=torch.Generator().manual_seed(1))
    few, amx = _batches_of_the_same_way()
    full = quantized_matmul(x, matrix)
    # with AMX the few-rows way's reference is each row alone; else the 48 rows are of its way
    by_row = torch.cat([quantized_matmul(x[i : i + 1], matrix) for i in range(48)]) if amx else full
    for start, rows in few:
        assert torch.equal(quantized_matmul(x[start : start + rows], matrix), by_row[start : start + rows])
    for start, rows in amx:
        assert torch.equal(quantized_matmul(x[start : start + rows], matrix), full[start : start + rows])
    assert amx or amx_way == "no-amx" or not quant.set_amx(True)


def test_the_default_model_keeps_its_quantized_blocks(smollm_llm):
    """Every projection and the tied table stay GGUF-packed (no float copy), and the packed
    products agree with the dequantized weights (and q/k row order)."""
    model = smollm_llm.llm_engine.executor.worker.model
    layer = {name: layer_of(model, w) for name, w in model.layer_projections(0).items()}
    qkv = layer["qkv_proj"].quant_method
    assert isinstance(qkv, GGUFLinear) and qkv.qtypes == ["Q4_1"]
    assert qkv.out_features == 576 + 2 * 192
    assert layer["gate_up_proj"].quant_method.out_features == 2 * 1536
    assert layer["down_proj"].quant_method.in_features == 1536
    assert model.lm_head.quant_method.qtypes == ["Q8_0"]  # the tied embedding table
    assert model.lm_head.quant_method is model.model.embed_tokens.quant_method
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    for module in (layer["qkv_proj"], layer["gate_up_proj"], model.lm_head):
        assert module.weight.dtype == torch.uint8 and module.weight.dim() == 1  # the packed bytes only
        dense = module.quant_method.to_float(module)
        torch.testing.assert_close(module.quant_method.apply(module, x), x @ dense.T, atol=5e-4, rtol=1e-4)


def test_packed_weights_refuse_activations_they_cannot_multiply(smollm_llm):
    model = smollm_llm.llm_engine.executor.worker.model
    with pytest.raises(TypeError, match="float32 CPU activations"):
        model.lm_head.quant_method.apply(model.lm_head, torch.zeros(1, 576, dtype=torch.bfloat16))


def test_the_environment_variable_turns_the_amx_way_off():
    # PAGEDLLM_QUANT_AMX=0: a benchmark's run without the tiles, in a fresh process.
    import os
    import subprocess
    import sys

    code = "from pagedllm.kernels import quant; print(quant.amx_min_rows(), quant.float_isa())"
    off = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PAGEDLLM_QUANT_AMX": "0"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert off[0] == "0" and "AMX" not in " ".join(off[1:])
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert on[0] == ("10" if _cpu_has_amx_bf16() else "0")
