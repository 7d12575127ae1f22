"""The cpu-1b profile of `pagedllm bench paper`: a model of the user's choosing on the real
clock, its step cost calibrated on that model and reused only for it, and clear errors for
settings that do not belong together. A tiny random model stands in for the 1B file."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest

from pagedllm.bench.paper import calibrate as calibrate_module
from pagedllm.bench.paper.context import Context
from pagedllm.bench.paper.costs import LinearCost
from pagedllm.bench.paper.profiles import get_profile
from pagedllm.bench.paper.real import build_engine
from pagedllm.bench.paper.search import Pool


def test_the_profile_calibrates_on_its_model_and_reuses_that_calibration_only_for_it(tiny_llama, tmp_path, monkeypatch):
    profile = get_profile("cpu-1b", tmp_path, model=str(tiny_llama), kv_slots=1024, threads=1)
    assert profile.model == str(tiny_llama) and profile.threads == 1 and profile.scale.kv_slots == 1024
    saved = json.loads((tmp_path / "calibration_cpu-1b.json").read_text())
    assert saved["model"]["model"] == str(tiny_llama.resolve()) and saved["threads"] == 1
    assert saved["fit"]["num_steps"] > 50 and profile.cost.c_step > 0
    # Calibrated at twice the budget; the profile itself serves the budget asked for.
    assert saved["scale"]["kv_slots"] == 2048

    calls = []
    monkeypatch.setattr(calibrate_module, "calibrate", lambda *a, **k: calls.append(a) or (_ for _ in ()).throw(
        AssertionError("recalibrated")))
    again = get_profile("cpu-1b", tmp_path, model=str(tiny_llama), kv_slots=1024, threads=1)
    assert again.cost == profile.cost and not calls  # the same model, CPU, threads and scale: reused
    with pytest.raises(AssertionError, match="recalibrated"):  # other threads: measured again
        get_profile("cpu-1b", tmp_path, model=str(tiny_llama), kv_slots=1024, threads=2)


def test_the_real_clock_runs_the_profiles_model_and_names_it(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(calibrate_module, "load_or_calibrate", lambda *a, **k: None)
    profile = get_profile("cpu-1b", tmp_path, model=str(tiny_llama), kv_slots=1024, threads=1)
    ctx = Context(profile, "real", tmp_path, Pool(1), None)
    assert ctx.tag == "real-cpu-1b" and tiny_llama.name in ctx.where()
    engine = build_engine(profile.scale, model=profile.model, threads=profile.threads)
    try:
        assert engine.config.model.model == str(tiny_llama)
        assert engine.scheduler.block_manager.num_total_blocks == 1024 // 16
    finally:
        engine.shutdown()


def test_settings_that_do_not_belong_together_are_refused(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="add --profile cpu-1b"):
        get_profile("cpu", tmp_path, model=str(tiny_llama))
    with pytest.raises(ValueError, match="does not exist"):
        get_profile("cpu-1b", tmp_path, model=str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="--kv-slots must be a multiple of 16"):
        get_profile("cpu-1b", tmp_path, model=str(tiny_llama), kv_slots=1000)


def _kv_budget_script():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "paper_kv_budget.py"
    spec = importlib.util.spec_from_file_location("paper_kv_budget", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_kv_budget_table_shows_memory_binding_only_where_the_step_is_flat(tmp_path):
    """benchmarks/paper_kv_budget.py, which states how cpu-1b's budget was chosen: with a step that
    barely grows with the batch (an A100's), the smallest pool holds vLLM below its unbounded rate and
    its larger batches beat Orca's; with a CPU's step, which grows ~40% a sequence, the CPU binds first."""
    table = _kv_budget_script().budget_table
    flat = LinearCost(name="flat", c_step=0.03, c_prefill=0.0002, c_decode=0.0003, c_kv=0.0, c_copy_token=0.0,
                      c_swap_token=0.0)
    steep = replace(flat, name="steep", c_step=0.015, c_decode=0.0125)
    flat_rows = table(flat, [65536, 1024], tmp_path / "flat", requests=80)
    steep_rows = table(steep, [1024, 65536], tmp_path / "steep", requests=80)
    assert [r["kv_slots"] for r in flat_rows] == [1024, 65536] and flat_rows[-1]["share_of_largest"] == 1.0
    assert flat_rows[0]["share_of_largest"] < 0.8 and flat_rows[0]["over_oracle"] > 1.3
    assert steep_rows[0]["over_oracle"] < flat_rows[0]["over_oracle"]
    assert steep_rows[0]["share_of_largest"] > flat_rows[0]["share_of_largest"]
