"""The preemption-cost profile: measured once per machine, model and configuration, then read."""

from __future__ import annotations

import json

import pytest

from pagedllm import LLM
from pagedllm.worker import profile_cache
from pagedllm.worker.worker import Worker


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PAGEDLLM_MODEL_CACHE", raising=False)
    return tmp_path


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


def test_a_broken_entry_is_measured_again(cache):
    profile_cache.cached_preemption_costs(("m",), counting((1.0, 2.0))[0])
    (entry,) = (cache / "profiles").glob("*.json")
    entry.write_text(json.dumps({"swap_s_per_block": "fast"}))
    measure, calls = counting((3.0, 4.0))
    assert profile_cache.cached_preemption_costs(("m",), measure) == (3.0, 4.0) and calls == [1]


def test_the_model_cache_switch_measures_every_time(cache, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_MODEL_CACHE", "0")
    measure, calls = counting((1.0, 2.0))
    for _ in range(2):
        profile_cache.cached_preemption_costs(("m",), measure)
    assert len(calls) == 2 and not (cache / "profiles").exists()


def test_a_second_engine_start_reads_the_profile_and_schedules_alike(cache, tiny_llama, monkeypatch):
    measured = []
    real = Worker._measure_preemption_costs
    monkeypatch.setattr(Worker, "_measure_preemption_costs", lambda self, *a: measured.append(1) or real(self, *a))
    kwargs = dict(max_model_len=128, num_gpu_blocks=24, swap_space=1, preemption_mode="auto")
    first = LLM(str(tiny_llama), **kwargs).llm_engine.core.scheduler.config
    second = LLM(str(tiny_llama), **kwargs).llm_engine.core.scheduler.config
    assert measured == [1]
    assert 0 < first.swap_cost_per_block < float("inf") and 0 < first.recompute_cost_per_token
    assert (second.swap_cost_per_block, second.recompute_cost_per_token) == (
        first.swap_cost_per_block, first.recompute_cost_per_token)
    LLM(str(tiny_llama), **{**kwargs, "block_size": 8})  # another configuration: measured for it
    assert measured == [1, 1]
