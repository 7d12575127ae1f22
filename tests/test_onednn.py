"""Projections through oneDNN with weights packed at load time, against F.linear."""

from __future__ import annotations

import psutil
import pytest
import torch
import torch.nn.functional as F

from pagedllm.attention.reference import ReferenceAttentionBackend
from pagedllm.kernels import onednn
from pagedllm.model.layers import linear
from pagedllm.model.quant import layer_of
from pagedllm.model.loader import load_model
from pagedllm.transformers_utils import resolve_model


def test_onednn_is_available_on_this_build():
    # The fast float32 path of every CPU projection; a torch without it falls back to F.linear.
    assert onednn.available()


@pytest.mark.parametrize("rows", [1, 13, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 160, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 160, generator=gen)
    packed = onednn.pack(weight)
    torch.testing.assert_close(onednn.packed_linear(x, packed, b), F.linear(x, weight, b), atol=1e-4, rtol=1e-5)
    # Strided rows and a leading batch dimension are taken as they come.
    wide = torch.randn(rows, 320, generator=gen)[:, ::2]
    torch.testing.assert_close(onednn.packed_linear(wide, packed, b), F.linear(wide, weight, b), atol=1e-4, rtol=1e-5)
    x3 = torch.randn(2, rows, 160, generator=gen)
    torch.testing.assert_close(onednn.packed_linear(x3, packed, b), F.linear(x3, weight, b), atol=1e-4, rtol=1e-5)


def test_pack_declines_what_it_cannot_take():
    assert onednn.pack(torch.randn(16)) is None
    assert onednn.pack(torch.randn(8, 16, dtype=torch.float64)) is None
    for dtype in (torch.bfloat16, torch.float16):
        packed = onednn.pack(torch.randn(8, 16, dtype=dtype))
        assert (packed is not None) == onednn.packing_pays(dtype)


def test_16_bit_packing_needs_the_instructions_and_survives_a_refusal(monkeypatch, caplog):
    monkeypatch.setattr(onednn, "_has_16_bit_instructions", lambda dtype: False)
    onednn.packing_pays.cache_clear()
    try:
        assert not onednn.packing_pays(torch.bfloat16) and onednn.packing_pays(torch.float32)
        # A CPU that claims the instructions but whose oneDNN refuses the reorder (or any
        # failure of the trial) falls back to F.linear, saying why.
        monkeypatch.setattr(onednn, "_has_16_bit_instructions", lambda dtype: True)
        monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight",
                            lambda *args: (_ for _ in ()).throw(RuntimeError("no bf16 path here")), raising=False)
        onednn.packing_pays.cache_clear()
        with caplog.at_level("INFO", logger="pagedllm"):
            assert not onednn.packing_pays(torch.bfloat16)
        assert "no bf16 path here" in caplog.text
    finally:
        onednn.packing_pays.cache_clear()


@pytest.mark.skipif(not onednn._has_16_bit_instructions(torch.bfloat16),
                    reason="needs a CPU with AVX-512 BF16 or AMX: oneDNN refuses bfloat16 reorders elsewhere")
@pytest.mark.parametrize("rows", [1, 13, 300])
def test_packed_bfloat16_linear_equals_a_float32_product_within_bfloat16_rounding(rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 160, generator=gen).bfloat16()
    x = torch.randn(rows, 160, generator=gen).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    expected = F.linear(x.float(), weight.float())
    torch.testing.assert_close(onednn.packed_linear(x, packed).float(), expected, rtol=1e-2, atol=0.1)


def test_loaded_models_pack_every_projection_and_linear_uses_it(tiny_llama, monkeypatch):
    model = load_model(resolve_model(str(tiny_llama)), 64, ReferenceAttentionBackend(), torch.float32, torch.device("cpu"))
    layers = [layer_of(model, w) for w in [*model.layer_projections(0).values(), model.lm_head.weight]]
    assert all(m.quant_method.packed is not None for m in layers)
    x = torch.randn(5, layers[0].weight.shape[1])
    calls = []
    monkeypatch.setattr(onednn, "packed_linear", lambda *args: calls.append(args) or F.linear(x, layers[0].weight))
    linear(x, layers[0])
    assert len(calls) == 1 and calls[0][1] is layers[0].quant_method.packed


def test_row_counts_run_at_a_bounded_set_of_buckets_with_little_padding():
    buckets = {onednn.row_bucket(rows) for rows in range(1, onednn.CHUNK_ROWS + 1)}
    assert len(buckets) == 48 and max(buckets) == onednn.CHUNK_ROWS
    for rows in range(1, onednn.CHUNK_ROWS + 1):
        assert rows <= onednn.row_bucket(rows) <= rows * 1.125


@pytest.mark.parametrize("rows", [15, 17, 255, 256, 257, 513, 700])
def test_padded_and_chunked_products_equal_f_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    x = torch.randn(rows, 24, generator=gen)
    out = onednn.packed_linear(x, onednn.pack(weight), bias)
    assert out.shape == (rows, 40)
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def test_every_row_count_does_not_grow_memory():
    """oneDNN caches a JIT-built primitive (~0.6 MB) per shape of product: without the buckets,
    the 600 row counts below would keep ~360 MB."""
    packed = onednn.pack(torch.randn(48, 32))
    process = psutil.Process()
    before = process.memory_info().rss
    for rows in range(1, 601):
        onednn.packed_linear(torch.ones(rows, 32), packed)
    grown = process.memory_info().rss - before
    assert grown < 100 << 20, f"RSS grew {grown >> 20} MiB over 600 row counts"
