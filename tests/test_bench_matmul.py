"""`pagedllm bench matmul`: one record per row count, every path timed, the table names each."""

from __future__ import annotations

import json

import pytest

from pagedllm.cli import main


@pytest.mark.slow
def test_bench_matmul_writes_one_record_per_row_count(tmp_path, capsys):
    out = tmp_path / "matmul.json"
    assert main(["bench", "matmul", "--rows", "16", "1", "--repeats", "1", "--output-json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "matmul"
    records = payload["results"]
    assert [r["rows"] for r in records] == [1, 16]
    for record in records:
        for path in ("quant", "onednn", "linear", "int8"):
            assert record[f"{path}_ms"] > 0 and record[f"{path}_GFLOPs"] > 0
        assert record["fastest"] in ("quant", "onednn", "linear")
    # Every layer's four projections and the LM head.
    assert payload["config"]["num_projections"] % 4 == 1
    assert payload["config"]["isa"] in ("portable", "avx2", "avx512", "amx")
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rows", "quant_ms"])
    assert [line.split()[0] for line in lines[header + 2 : header + 4]] == ["1", "16"]


@pytest.mark.slow
def test_bench_matmul_quant_column_is_the_float_product():
    # The quant column multiplies the model's own packed parts (Q4_1 and Q8_0 in the first
    # layer): the products of their dequantized weights, to float32 rounding.
    import torch
    import torch.nn.functional as F

    from pagedllm.attention.reference import ReferenceAttentionBackend
    from pagedllm.bench.matmul import path_fns, step_layers
    from pagedllm.model import load_model
    from pagedllm.transformers_utils import resolve_model

    model = load_model(resolve_model(None), 64, ReferenceAttentionBackend(), torch.float32, torch.device("cpu"))
    layers = step_layers(model)[:4]  # the first layer's projections: Q4_1 and Q8_0
    fns, floats = path_fns(layers)
    xs = {k: torch.randn(5, k, generator=torch.Generator().manual_seed(k)) for k in {w.shape[1] for w in floats}}
    with torch.inference_mode():
        for y, w in zip(fns["quant"](xs), floats):
            torch.testing.assert_close(y, F.linear(xs[w.shape[1]], w), atol=1e-3, rtol=1e-4)


@pytest.mark.slow
def test_bench_matmul_times_the_avx512_way_beside_the_amx_one():
    # On AMX CPUs the quant column takes the tiles; quant_no_amx runs the AVX-512 path for its
    # own calls only: both agree with the float product, and the AMX path is back after it.
    import torch
    import torch.nn.functional as F

    from pagedllm.attention.reference import ReferenceAttentionBackend
    from pagedllm.bench.matmul import path_fns, step_layers
    from pagedllm.kernels import gguf
    from pagedllm.model import load_model
    from pagedllm.transformers_utils import resolve_model

    if gguf.isa() != "amx":
        pytest.skip("no AMX way on this CPU: the column is not timed")
    model = load_model(resolve_model(None), 64, ReferenceAttentionBackend(), torch.float32, torch.device("cpu"))
    fns, floats = path_fns(step_layers(model)[:4])
    xs = {k: torch.randn(16, k, generator=torch.Generator().manual_seed(k)) for k in {w.shape[1] for w in floats}}
    with torch.inference_mode():
        for path in ("quant", "quant_no_amx"):
            for y, w in zip(fns[path](xs), floats):
                torch.testing.assert_close(y, F.linear(xs[w.shape[1]], w), atol=1e-3, rtol=1e-4)
    assert gguf.isa() == "amx"
