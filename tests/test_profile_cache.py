"""The preemption-cost profile: measured once per machine, model and configuration, then read."""

from __future__ import annotations

import json
import logging
import time

import pytest

from pagedllm import LLM
from pagedllm.paths import cache_dir
from pagedllm.worker import profile_cache
from pagedllm.worker.worker import Worker


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache folder (never the user's profiles), sharing the built CPU kernels: a
    folder of its own would compile them again (a minute) for the engines started here."""
    (tmp_path / "kernels").symlink_to(shared_kernels(), target_is_directory=True)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PAGEDLLM_MODEL_CACHE", raising=False)
    return tmp_path


def shared_kernels():
    folder = cache_dir() / "kernels"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def counting(costs):
    calls = []

    def measure():
        calls.append(1)
        return costs

    return measure, calls


def test_measured_once_per_configuration_then_read_back(cache):
    measure, calls = counting((0.002, 0.0005))
    assert profile_cache.cached_preemption_costs(("model-a", 16), measure) == (0.002, 0.0005)
    assert profile_cache.cached_preemption_costs(("model-a", 16), counting((9.0, 9.0))[0]) == (0.002, 0.0005)
    assert len(calls) == 1
    other, other_calls = counting((0.004, 0.001))
    assert profile_cache.cached_preemption_costs(("model-a", 32), other) == (0.004, 0.001)  # another block size
    assert len(other_calls) == 1 and len(list((cache / "profiles").glob("*.json"))) == 2


@pytest.mark.parametrize("broken", [json.dumps({"swap_s_per_block": "fast"}), "{not json", json.dumps(
    {"swap_s_per_block": -1.0, "recompute_s_per_token": 0.001})])
def test_a_broken_entry_is_ignored_with_a_warning_and_measured_again(cache, caplog, broken):
    profile_cache.cached_preemption_costs(("m",), counting((1.0, 2.0))[0])
    (entry,) = (cache / "profiles").glob("*.json")
    entry.write_text(broken)
    measure, calls = counting((3.0, 4.0))
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert profile_cache.cached_preemption_costs(("m",), measure) == (3.0, 4.0) and calls == [1]
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "Ignoring the preemption-cost cache file" in warning.getMessage() and str(entry) in warning.getMessage()
    assert json.loads(entry.read_text())["swap_s_per_block"] == 3.0  # measured again and kept


def test_the_log_says_whether_it_measures_or_reads_and_when_it_measured(cache, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        profile_cache.cached_preemption_costs(("m",), counting((0.002, 0.0005))[0])
    first = [r.getMessage() for r in caplog.records]
    assert first[0].startswith("Measuring preemption costs on this machine") and "kept for the next start" in first[0]
    assert first[1].startswith("Measured the preemption costs in") and "2 ms to swap a block out and in" in first[1]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        profile_cache.cached_preemption_costs(("m",), counting((9.0, 9.0))[0])
    (entry,) = (cache / "profiles").glob("*.json")
    (line,) = [r.getMessage() for r in caplog.records]
    today = time.strftime("%Y-%m-%d")
    assert line.startswith(f"Using the preemption costs measured on {today}") and f"cache file {entry}" in line
    assert "0.5 ms to recompute a token" in line


def test_the_model_cache_switch_measures_every_time(cache, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_MODEL_CACHE", "0")
    measure, calls = counting((1.0, 2.0))
    for _ in range(2):
        profile_cache.cached_preemption_costs(("m",), measure)
    assert len(calls) == 2 and not (cache / "profiles").exists()


def test_a_second_engine_start_reads_the_profile_and_schedules_alike(cache, tiny_llama, monkeypatch, caplog):
    measured = []
    real = Worker._measure_preemption_costs
    monkeypatch.setattr(Worker, "_measure_preemption_costs", lambda self, *a: measured.append(1) or real(self, *a))
    kwargs = dict(max_model_len=128, num_gpu_blocks=24, swap_space=1, preemption_mode="auto")
    first = LLM(str(tiny_llama), **kwargs).llm_engine.core.scheduler.config
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        second = LLM(str(tiny_llama), **kwargs).llm_engine.core.scheduler.config
    assert measured == [1]
    assert any(r.getMessage().startswith("Using the preemption costs measured on") for r in caplog.records)
    assert not any("Measuring preemption costs" in r.getMessage() for r in caplog.records)
    assert 0 < first.swap_cost_per_block < float("inf") and 0 < first.recompute_cost_per_token
    assert (second.swap_cost_per_block, second.recompute_cost_per_token) == (
        first.swap_cost_per_block, first.recompute_cost_per_token)
    LLM(str(tiny_llama), **{**kwargs, "block_size": 8})  # another configuration: measured for it
    assert measured == [1, 1]
