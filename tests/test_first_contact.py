"""A first start says what it does: a line before the kernels' build, and one summary once the
engine is ready (model, compute, weights and their real bytes, KV cache, memory)."""

from __future__ import annotations

import logging
import re
import stat

import pytest
import torch

from pagedllm import LLM
from pagedllm.kernels import build, gguf
from pagedllm.model import layers
from pagedllm.model.quant import EVERY_SIZE
from pagedllm.paths import cache_dir


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache folder (never the user's) that shares the built CPU kernels: a folder of
    its own would compile them again (a minute)."""
    kernels = cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "kernels").symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PAGEDLLM_MODEL_CACHE", raising=False)
    return tmp_path


# --- the kernels' build -------------------------------------------------------------------------


@pytest.fixture
def fake_compiler(tmp_path, monkeypatch):
    """A "compiler" that writes an empty file wherever -o points: the build's steps, in no time."""
    script = tmp_path / "fake-cxx"
    script.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = "-o" ] && : > "$2"; shift; done\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(script))
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))


def test_a_build_is_announced_before_it_starts_and_timed_and_a_built_library_is_not(fake_compiler, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        path = build.build()
    before, after = (r.getMessage() for r in caplog.records)
    assert before.startswith("Building the CPU kernels (first start on this machine") and before.endswith("...")
    assert re.match(r"Built the CPU kernels in [\d.]+ s: ", after) and str(path) in after
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert build.build() == path  # built: nothing to say
    assert not caplog.records


# --- the start-up summary -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_q4_1(tmp_path_factory):
    """A 2-layer Llama GGUF: Q4_1 projections, a tied Q8_0 table, the default model's tokenizer."""
    from pagedllm.transformers_utils import resolve_model
    from tests.gguf_writer import tokenizer_fields, write_random_llama

    path = tmp_path_factory.mktemp("first-contact") / "tiny-q4_1.gguf"
    return write_random_llama(path, {"default": "Q4_1", "token_embd": "Q8_0"}, hidden=256, intermediate=512,
                              vocab=49152, tokenizer=tokenizer_fields(resolve_model(None).path))


def tensor_bytes(model: torch.nn.Module) -> int:
    """Every parameter and buffer at its stored size, a tied one once: counted here apart from
    the engine's own count."""
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_the_summary_names_what_runs_and_the_weights_real_bytes(cache, tiny_q4_1, monkeypatch, caplog):
    monkeypatch.setattr(layers, "int8_rows_that_pay", lambda qtype: 8)  # no int8 trial (seconds) here
    monkeypatch.setattr(layers, "set_ways_for_width", lambda qtype, in_features: EVERY_SIZE)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(str(tiny_q4_1), max_model_len=128, num_gpu_blocks=24, swap_space=1)
    try:
        (summary,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Engine ready:")]
        worker = llm.llm_engine.executor.worker
        assert f"tiny-q4_1 (LlamaForCausalLM) from {tiny_q4_1}" in summary
        compute = re.search(r"compute: float32 on cpu, (\d+) threads, CPU kernels (.+), attention (\w+)", summary)
        assert compute, summary
        assert int(compute[1]) == torch.get_num_threads() and compute[2] == gguf.ISA_NAMES[gguf.isa()]
        forms = re.search(r"weights: GGUF (Q4_1|Q8_0) \d+%, (Q4_1|Q8_0) \d+%; [\d.]+ MiB", summary)
        assert forms and {forms[1], forms[2]} == {"Q4_1", "Q8_0"}, summary
        assert "KV cache: 24 blocks x 16 tokens = 384 tokens" in summary and "max_model_len 128" in summary
        assert re.search(r"preemption: auto \(swap [\d.e-]+ ms a block, recompute [\d.e-]+ ms a token\)", summary), summary
        assert re.search(r"Memory: weights [\d.]+ MiB \([\d.]+ MiB of it resident\)", summary), summary
        # The weights' bytes: every tensor the model holds, quantized blocks at their packed size.
        expected = tensor_bytes(worker.model)
        logged = float(re.search(r"weights: .*; ([\d.]+) MiB", summary)[1]) * 2**20
        assert abs(logged - expected) <= 0.1 * expected
        assert abs(worker.memory_budget().weights - expected) <= 0.1 * expected
        # Far more than float32 parameters would have been counted as: each byte of blocks is a
        # parameter element here, and the file holds about those bytes.
        assert expected >= 0.8 * (tiny_q4_1.stat().st_size - 2 * 2**20)
    finally:
        llm.llm_engine.shutdown()


def test_a_warm_start_counts_weights_that_are_not_read_in_yet(cache, tiny_q4_1, monkeypatch, caplog):
    """Mapped from the weight cache and never read (the preemption profile kept, so no forward
    pass ran), the weights are mostly not resident; their bytes are counted all the same."""
    monkeypatch.setattr(layers, "int8_rows_that_pay", lambda qtype: 8)
    monkeypatch.setattr(layers, "set_ways_for_width", lambda qtype, in_features: EVERY_SIZE)
    kwargs = dict(max_model_len=128, num_gpu_blocks=24, swap_space=1)
    LLM(str(tiny_q4_1), **kwargs)  # fills the weight cache and the profile
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        worker = LLM(str(tiny_q4_1), **kwargs).llm_engine.executor.worker
    assert any("from the weight cache" in r.getMessage() for r in caplog.records)
    budget = worker.memory_budget()
    assert abs(budget.weights - tensor_bytes(worker.model)) <= 0.1 * tensor_bytes(worker.model)
    assert budget.weights >= budget.weights_resident
