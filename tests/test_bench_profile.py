"""`pagedllm bench latency --profile`: each part of a decode step timed in place, exclusively (a
nested part is not counted twice), the hooks present only while profiling."""

from __future__ import annotations

import json
import pytest

from pagedllm.bench.step_profile import PARTS, StepProfiler, profile_decode_steps
from pagedllm.cli import main
from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.model import layers
from pagedllm.model.layers import RMSNorm
from pagedllm.sampling_params import SamplingParams

ENGINE_KWARGS = dict(max_model_len=256, num_gpu_blocks=128, disable_log_stats=True)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), **ENGINE_KWARGS))
    yield engine
    engine.shutdown()


def _prefilled(engine, batch: int, decode_steps: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{i}", [100 + i + j for j in range(20)], params)
    engine.step()  # the prompts


class FakeClock:
    """perf_counter_ns that moves only when the code under test "works"."""

    def __init__(self) -> None:
        self.now = 0

    def perf_counter_ns(self) -> int:
        return self.now

    def work(self, ns: int) -> None:
        self.now += ns


def test_nested_part_is_subtracted_from_its_parent_unless_it_absorbs(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("pagedllm.bench.step_profile.time", clock)
    profiler = StepProfiler()
    inner = profiler.wrap("inner", lambda: clock.work(30))
    outer = profiler.wrap("outer", lambda: (clock.work(20), inner(), inner(), clock.work(5)))
    outer()
    assert dict(profiler.part_ns) == {"outer": 25, "inner": 60}
    assert dict(profiler.calls) == {"outer": 1, "inner": 2}

    absorbing = StepProfiler()
    inner = absorbing.wrap("inner", lambda: clock.work(30))
    absorbing.wrap("outer", lambda: (clock.work(20), inner()), absorb=True)()
    assert dict(absorbing.part_ns) == {"outer": 50}


def test_every_part_of_a_decode_step_is_timed_where_its_code_runs(engine):
    num_layers = engine.arch.num_layers
    _prefilled(engine, batch=3, decode_steps=4)
    steps, parts, calls = profile_decode_steps(engine, 4)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(steps) == 4
    per_step = {part: n / len(steps) for part, n in calls.items()}
    assert per_step["projections"] == 4 * num_layers  # qkv, o, gate_up, down; the LM head apart
    assert per_step["norms"] == 2 * num_layers + 1
    for part in ("rotary", "kv_write", "attention", "mlp_activation"):
        assert per_step[part] == num_layers, part
    for part in ("embedding", "lm_head", "sampling"):
        assert per_step[part] == 1, part
    assert per_step["input_prep"] >= 1
    for part in PARTS:
        if part not in ("other", "copies"):  # (the layer loop takes q, k and v as views: no copies)
            assert parts[part] > 0, part
    assert "copies" not in calls and parts["copies"] == 0
    # The named parts never exceed the step (no time is counted twice), and with the remainder
    # they add up to it.
    named = sum(v for k, v in parts.items() if k != "other")
    assert named <= sum(steps)
    assert abs(named + parts["other"] - sum(steps)) <= 0.05 * sum(steps)


def test_hooks_are_installed_only_while_profiling(engine):
    originals = (RMSNorm.__dict__["forward"], layers.linear)
    profiler = StepProfiler()
    with pytest.raises(RuntimeError, match="boom"):
        with profiler.installed(engine):
            assert layers.linear is not originals[1]
            raise RuntimeError("boom")
    assert (RMSNorm.__dict__["forward"], layers.linear) == originals
    # Unprofiled steps record nothing.
    _prefilled(engine, batch=1, decode_steps=2)
    while engine.has_unfinished_requests():
        engine.step()
    assert not profiler.calls


def test_latency_profile_prints_the_parts_and_the_bound(tiny_llama, engine, tmp_path, capsys):
    out = tmp_path / "latency.json"
    args = ["bench", "latency", str(tiny_llama), "--max-model-len", "256", "--num-gpu-blocks", "128",
            "--batch-size", "2", "--input-len", "16", "--output-len", "4", "--num-iters", "1",
            "--profile", "--profile-steps", "3", "--output-json", str(out)]
    assert main(args) == 0
    profile = json.loads(out.read_text())["config"]["profile"]
    rows = {row["part"]: row for row in profile["rows"]}
    assert set(PARTS) | {"step (measured)"} == set(rows)
    total = sum(rows[part]["ms_per_step"] for part in PARTS)
    assert total == pytest.approx(profile["step_ms"], rel=0.05)
    assert profile["bound_ms"] > 0 and profile["copy_bandwidth_gbps"] > 0
    # The bound's matrix rate is the faster of the run's two readings, and the bound adds up.
    config = json.loads(out.read_text())["config"]
    assert profile["matrix_gflops"] >= config["matmul_gflops"]
    # Matrix products: the longer of their FLOPs at that rate and reading the stored weights once
    # (the tiny model ties nothing: every parameter once, but the embedding table, of which a step
    # reads its looked-up rows).
    bandwidth = profile["copy_bandwidth_gbps"] * 1e9
    model = engine.executor.worker.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes -= model.embedding_weight.numel() * model.embedding_weight.element_size()
    assert profile["weight_bytes"] == weight_bytes
    matrix_s = max(2 * engine.arch.num_parameters * 2 / (profile["matrix_gflops"] * 1e9), weight_bytes / bandwidth)
    expected = matrix_s + profile["kv_bytes"] / bandwidth
    assert profile["bound_ms"] == pytest.approx(1e3 * expected, rel=1e-6)
    printed = capsys.readouterr().out
    assert "decode step profile" in printed and "physical bound" in printed and "attention" in printed


def test_latency_runs_its_batch_together_whatever_the_step_budget(tiny_llama, tmp_path):
    """The batch's prompts run in one step and it decodes together: a step-time budget that
    spreads prompts over steps (here a tiny one) would let the first sequences finish before
    the last began, and no step would decode the whole batch."""
    out = tmp_path / "latency.json"
    args = ["bench", "latency", str(tiny_llama), "--max-model-len", "256", "--num-gpu-blocks", "128",
            "--batch-size", "6", "--input-len", "64", "--output-len", "2", "--num-iters", "1",
            "--max-step-seconds", "0.000001", "--output-json", str(out)]
    assert main(args) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["batch"] == 6 and row["tpot_ms"] > 0


def test_a_mixtures_bound_counts_the_experts_its_tokens_can_reach(tiny_models):
    """A decode step of one sequence reads k of a mixture's E experts (the tiny Qwen3-MoE: 2 of
    4 in each layer), of two sequences up to all four: the bound's bytes count those (and not the
    embedding table, untied here: a step reads its looked-up rows only)."""
    import torch

    from pagedllm.attention.reference import ReferenceAttentionBackend
    from pagedllm.bench.latency import step_weight_bytes
    from pagedllm.model import load_model
    from pagedllm.transformers_utils import resolve_model

    model = load_model(resolve_model(str(tiny_models("qwen3_moe"))), 128, ReferenceAttentionBackend(), torch.float32,
                       torch.device("cpu"))
    stored = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    experts = [layer.mlp.experts for layer in model.model.layers]
    expert_bytes = sum(p.numel() * p.element_size() for e in experts for p in (e.gate_up_proj, e.down_proj))
    assert model.embedding_weight.data_ptr() != model.lm_head.weight.data_ptr()
    stored -= model.embedding_weight.numel() * model.embedding_weight.element_size()
    assert step_weight_bytes(model, 1) == stored - expert_bytes / 2
    assert step_weight_bytes(model, 2) == stored
