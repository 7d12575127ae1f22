"""`pagedllm bench gguf-kernels`: one record per type and row count, every path timed."""

from __future__ import annotations

import json

import pytest

from pagedllm.cli import main


@pytest.mark.slow
def test_bench_gguf_kernels_writes_one_record_per_type_and_row_count(tmp_path, capsys):
    out = tmp_path / "gguf.json"
    args = ["bench", "gguf-kernels", "--types", "Q4_K", "Q8_0", "--rows", "2", "1", "--repeats", "1",
            "--bandwidth-mb", "64", "--output-json", str(out)]
    assert main(args) == 0
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "gguf-kernels"
    assert payload["config"]["read_bandwidth_GBps"] > 0
    # the int8 peak loop, and every int8 product's multiply-adds as a share of it
    assert payload["config"]["int8_peak_GMACs"] > 0 and payload["config"]["peak_instruction"]
    records = payload["results"]
    assert [(r["type"], r["rows"]) for r in records] == [("Q4_K", 1), ("Q4_K", 2), ("Q8_0", 1), ("Q8_0", 2)]
    for record in records:
        for path in ("gguf", "gguf_int8", "torch"):
            assert record[f"{path}_ms"] > 0 and record[f"{path}_GFLOPs"] > 0
        assert record["gguf_bound_pct"] > 0
        macs = record["rows"] * payload["config"]["num_weights"]
        assert record["int8_GMACs"] == pytest.approx(macs / (record["gguf_int8_ms"] / 1e3) / 1e9)
        assert record["int8_peak_pct"] == pytest.approx(100 * record["int8_GMACs"] / payload["config"]["int8_peak_GMACs"])
    # one set of kernels for every type: no column of another for Q8_0
    assert not [key for r in records for key in r if key.startswith("old")]
    assert "cpu:" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_gguf_kernels_times_an_lm_head(tmp_path):
    """`--shapes head-152k`: one weight of the vocabulary's rows, its bytes and share of the bound."""
    out = tmp_path / "head.json"
    args = ["bench", "gguf-kernels", "--shapes", "head-152k", "--types", "Q6_K", "--rows", "1", "--repeats", "1",
            "--bandwidth-mb", "64", "--output-json", str(out)]
    assert main(args) == 0
    payload = json.loads(out.read_text())
    assert payload["config"]["shapes"] == [[151936, 1024]]
    (record,) = payload["results"]
    assert record["MB"] == pytest.approx(151936 * 1024 // 256 * 210 / 1e6)
    assert record["int8_bound_pct"] > 0


@pytest.mark.slow
def test_a_type_whose_blocks_do_not_fit_the_rows_is_skipped_not_fatal(tmp_path, capsys):
    """Gemma's 262k x 640 head: 640 is no multiple of Q6_K's 256, so Q6_K is skipped with a line
    saying why and Q8_0 (blocks of 32) is timed."""
    out = tmp_path / "head.json"
    args = ["bench", "gguf-kernels", "--shapes", "head-262k", "--types", "Q6_K", "Q8_0", "--rows", "1",
            "--repeats", "1", "--bandwidth-mb", "64", "--output-json", str(out)]
    assert main(args) == 0
    assert [r["type"] for r in json.loads(out.read_text())["results"]] == ["Q8_0"]
    assert "Q6_K: skipped: rows of 640 weights are not whole blocks of 256" in capsys.readouterr().out
