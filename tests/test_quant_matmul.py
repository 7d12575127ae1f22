"""Matmuls from GGUF-quantized blocks (Q4_1, Q8_0) against the dequantized float weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm.kernels.quant import MAX_ROWS, QuantizedMatrix, quantized_matmul, usable


def _quantized(qtype: str, out_features: int, in_features: int, seed: int):
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((out_features, in_features)).astype(np.float32)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    blocks = gguf.quants.quantize(dense, kind)
    return QuantizedMatrix(qtype, torch.from_numpy(blocks), in_features), torch.from_numpy(gguf.quants.dequantize(blocks, kind))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
# Every row-group size of the few-rows way and a group plus a rest; the tiled way from 8 rows: one
# 8-row panel (8), one 16-row panel part empty (11, 15) or full (16), a 16-row panel and an 8-row
# one (17, 24, 33), and past its 64-row blocks (137).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11, 15, 16, 17, 24, 33, MAX_ROWS, 2 * MAX_ROWS + 9])
# 130: the tiled way's last 12-row tile of W holds 10 rows; 97: an odd row of W after the 1-row
# way's pairs
@pytest.mark.parametrize("shape", [(96, 64), (130, 576), (97, 64)])
def test_quantized_matmul_equals_the_dequantized_product(qtype, rows, shape):
    matrix, dense = _quantized(qtype, *shape, seed=rows)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(quantized_matmul(x, matrix), x @ dense.T, atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_the_tiled_way_gives_a_row_the_same_result_in_any_batch(qtype):
    # From 8 rows on, each output is one FMA chain over the inputs in order: the same bits whether
    # a row shares its product with 7 rows or 40, at any position.
    matrix, _ = _quantized(qtype, 130, 576, seed=1)
    x = torch.randn(48, 576, generator=torch.Generator().manual_seed(1))
    full = quantized_matmul(x, matrix)
    for start, rows in ((0, 8), (3, 8), (5, 17), (20, 28), (1, 40)):
        assert torch.equal(quantized_matmul(x[start : start + rows], matrix), full[start : start + rows])


def test_float32_cpu_products_of_any_row_count_use_it():
    matrix, _ = _quantized("Q8_0", 8, 32, seed=0)
    assert usable(matrix, torch.zeros(1, 32)) and usable(matrix, torch.zeros(4 * MAX_ROWS, 32))  # prompts too
    assert not usable(matrix, torch.zeros(1, 32, dtype=torch.bfloat16))
    assert not usable(None, torch.zeros(1, 32))


def test_the_default_model_keeps_its_quantized_blocks(smollm_llm):
    model = smollm_llm.llm_engine.executor.worker.model
    layer = model.layer_projections(0)
    assert layer["qkv_proj"].quantized.qtype == "Q4_1"
    assert layer["qkv_proj"].quantized.out_features == 576 + 2 * 192
    assert layer["gate_up_proj"].quantized.out_features == 2 * 1536
    assert layer["down_proj"].quantized.in_features == 1536
    assert model.lm_head.weight.quantized.qtype == "Q8_0"  # the tied embedding table
    # Unpacked for the kernel at load time, not during the first request's step.
    assert layer["down_proj"].quantized.is_unpacked and model.lm_head.weight.quantized.is_unpacked
    # Quantized and float paths agree on every layer's projections (and q/k row order).
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    for param in (layer["qkv_proj"], layer["gate_up_proj"], model.lm_head.weight):
        torch.testing.assert_close(quantized_matmul(x, param.quantized), x @ param.T, atol=5e-4, rtol=1e-4)
