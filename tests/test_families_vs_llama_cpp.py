"""benchmarks/families_vs_llama_cpp.py reads both benchmarks' reports and keeps the best pass of
each side (the runs themselves need llama.cpp built and model files: not run here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "families_vs_llama_cpp.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("families_vs_llama_cpp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _latency_report(tok_per_s: list[float], step_ms: float, bound_ms: float, parts: dict[str, float]) -> dict:
    return {"results": [{"decode_tok_per_s": t} for t in tok_per_s],
            "config": {"profile": {"step_ms": step_ms, "bound_ms": bound_ms, "copy_bandwidth_gbps": 40.0,
                                   "rows": [{"part": p, "ms_per_step": ms} for p, ms in parts.items()]}}}


def test_the_reports_are_read_for_tg_and_the_steps_python(script, monkeypatch, tmp_path):
    parts = {"scheduler": 0.1, "input_prep": 0.2, "embedding": 0.05, "projections": 5.0, "lm_head": 3.0,
             "sampling": 0.3, "outputs": 0.15, "other": 0.5}
    reports = {"llama": {"results": [{"test": "pp512", "tok_per_s": 900.0}, {"test": "tg128", "tok_per_s": 80.0}]},
               "ours": _latency_report([95.0, 101.0, 99.0], 10.0, 8.0, parts)}
    seen = []

    def fake_run(args, json_path):
        seen.append(args)
        return reports["llama" if args[1] == "llama-cpp" else "ours"]

    monkeypatch.setattr(script, "_run", fake_run)
    assert script.llama_cpp_tg(Path("m.gguf"), 2, tmp_path / "a.json") == 80.0  # tg, not the prompt's pp
    ours = script.pagedllm_latency(Path("m.gguf"), tmp_path / "b.json")
    assert ours["tok_per_s"] == 101.0 and ours["step_over_bound"] == 1.25
    assert ours["python_ms"] == pytest.approx(0.1 + 0.2 + 0.05 + 0.15 + 0.5)  # the kernels' parts left out
    assert seen[0][:3] == ["bench", "llama-cpp", "bench"] and "--profile" in seen[1]


def test_the_best_pass_of_each_side_makes_the_ratio(script):
    ours = [{"tok_per_s": 50.0, "step_over_bound": 1.6, "python_ms": 1.2},
            {"tok_per_s": 60.0, "step_over_bound": 1.3, "python_ms": 0.9}]
    row = script.summary("q.gguf", [55.0, 48.0], ours)
    assert row["llama_cpp_tok_per_s"] == 55.0 and row["pagedllm_tok_per_s"] == 60.0
    assert row["x"] == pytest.approx(60.0 / 55.0) and row["python_ms"] == 0.9
    assert row["step_over_bound"] == "1.60 1.30"  # every pass's, in order
