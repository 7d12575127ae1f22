"""Matmuls from GGUF-quantized blocks (Q4_1, Q8_0) against the dequantized float weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm.kernels.quant import MAX_ROWS, QuantizedMatrix, float_isa, quantized_matmul
from pagedllm.model.quantization import GGUFLinear, layer_of


def _quantized(qtype: str, out_features: int, in_features: int, seed: int):
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((out_features, in_features)).astype(np.float32)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    blocks = gguf.quants.quantize(dense, kind)
    return QuantizedMatrix(qtype, torch.from_numpy(blocks), in_features), torch.from_numpy(gguf.quants.dequantize(blocks, kind))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
# AVX2: every row-group size of the few-rows way and a group plus a rest; the tiled way from 8
# rows: one 8-row panel (8), one 16-row panel part empty (11, 15) or full (16), a 16-row panel and
# an 8-row one (17, 24, 33), and past its 64-row blocks (137). AVX-512: the wide way's every group
# size (1-8), two groups of each split (9 = 5 + 4, 10, 11, 12, 13, 14, 15, 16 = 8 + 8), three
# (17, 24), five (33), eight (64); the tiled way from 65.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 24, 33, MAX_ROWS,
                                  MAX_ROWS + 1, 2 * MAX_ROWS + 9])
# 130: the tiled way's last 12-row tile of W holds 10 rows; 97: an odd row of W after the pairs
@pytest.mark.parametrize("shape", [(96, 64), (130, 576), (97, 64)])
def test_quantized_matmul_equals_the_dequantized_product(qtype, rows, shape):
    matrix, dense = _quantized(qtype, *shape, seed=rows)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))
    torch.testing.assert_close(quantized_matmul(x, matrix), x @ dense.T, atol=2e-4, rtol=1e-5)


def _batches_of_the_same_way() -> tuple[tuple[int, int], ...]:
    """(first row, rows) of products that take one way, with one reduction order, on this build."""
    few = ((0, 1), (2, 1), (0, 2), (3, 4), (1, 5), (4, 9), (0, 16)) if float_isa() != "AVX2" else ()
    return ((0, 8), (3, 8), (5, 17), (20, 28), (1, 40)) + few


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_a_row_gets_the_same_result_in_any_batch_of_one_way(qtype):
    # Each output is one FMA chain over the inputs in an order that does not depend on the other
    # rows: the same bits whether a row shares its product with 7 rows or 40, at any position
    # (AVX2: from 8 rows on, the tiled way; AVX-512: 1 to 64 rows, the wide way; portable: all).
    matrix, _ = _quantized(qtype, 131, 576, seed=1)
    x = torch.randn(48, 576, generator=torch.Generator().manual_seed(1))
    full = quantized_matmul(x, matrix)
    for start, rows in _batches_of_the_same_way():
        assert torch.equal(quantized_matmul(x[start : start + rows], matrix), full[start : start + rows])


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
