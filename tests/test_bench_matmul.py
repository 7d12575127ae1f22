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
    assert payload["config"]["int8_isa"].split()[0] in ("AVX2", "AVX-VNNI", "AVX512-VNNI", "portable")
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rows", "quant_ms"])
    assert [line.split()[0] for line in lines[header + 2 : header + 4]] == ["1", "16"]
