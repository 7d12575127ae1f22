"""The cpu-1b profile of `pagedllm bench paper`: a model of the user's choosing on the real
clock, its step cost calibrated on that model and reused only for it, and clear errors for
settings that do not belong together. A tiny random model stands in for the 1B file."""

from __future__ import annotations

import json

import pytest

from pagedllm.bench.paper import calibrate as calibrate_module
from pagedllm.bench.paper.context import Context
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
