"""`pagedllm bench paper` end to end on the simulated clock, on tiny traces: it writes each
figure's PNG and JSON and the report, and the numbers keep the order the paper's argument rests
on (paged memory batches at least as many requests as any reservation policy)."""

from __future__ import annotations

import json

import pytest

from pagedllm.bench.paper.costs import A100_OPT13B, StepWork, step_work
from pagedllm.bench.paper.profiles import A100_SCALE
from pagedllm.bench.paper.simulator import SYSTEMS, Setup, simulate
from pagedllm.bench.paper.traces import make_trace, poisson_arrivals, workload
from pagedllm.cli import main


@pytest.fixture(scope="module")
def paper_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("paper")
    code = main(["bench", "paper", "--figures", "2,11,13", "--requests", "40", "--jobs", "1", "--output-dir", str(out)])
    assert code == 0
    return out


def test_each_figure_writes_a_png_and_json_saying_which_clock_made_it(paper_dir):
    for figure in ("2", "11", "13"):
        assert (paper_dir / f"fig{figure}_a100-opt13b.png").stat().st_size > 1000
        payload = json.loads((paper_dir / f"fig{figure}_a100-opt13b.json").read_text())
        assert payload["machine"]["cpu"]  # recorded by bench.report.write_json
        result = payload["results"]
        assert result["figure"] == figure and result["clock"] == "simulated" and result["profile"] == "a100-opt13b"
        for row in result["summary"]:
            assert set(row) == {"figure", "quantity", "paper", "ours", "clock", "target"}
            assert "simulated clock" in row["clock"]


def test_the_report_tabulates_every_figure(paper_dir):
    report = (paper_dir / "report.md").read_text()
    assert "| fig | quantity | paper | ours | clock | target |" in report
    for figure in ("2", "11", "13"):
        assert f"![Fig. {figure}](fig{figure}_a100-opt13b.png)" in report
    assert "312 TFLOP/s" in report  # the roofline's constants are stated


def test_paged_memory_batches_at_least_as_many_requests_as_every_baseline(paper_dir):
    data = json.loads((paper_dir / "fig13_a100-opt13b.json").read_text())["results"]["data"]
    for dataset in ("sharegpt", "alpaca"):
        batch = {s: r["mean_batched_requests"] for s, r in data[dataset]["systems"].items()}
        assert batch["vLLM"] >= batch["Orca (Oracle)"] >= batch["Orca (Max)"] > 0
        assert batch["Orca (Pow2)"] >= batch["Orca (Max)"]


def test_the_breakdown_puts_most_of_paged_memory_in_token_states(paper_dir):
    systems = json.loads((paper_dir / "fig2_a100-opt13b.json").read_text())["results"]["data"]["systems"]
    for name, parts in systems.items():
        assert sum(parts["all_steps"].values()) == pytest.approx(1.0)
    vllm = systems["vLLM"]["all_steps"]
    assert vllm["reservation"] == 0
    assert vllm["internal_fragmentation"] < systems["Orca (Max)"]["all_steps"]["internal_fragmentation"]


def test_the_simulator_is_deterministic_and_serves_every_request():
    requests = workload("alpaca", 30, 2048, seed=3)
    trace = make_trace(requests, rate=20.0)
    runs = [simulate(name, trace, Setup(policy, A100_SCALE), A100_OPT13B, 20.0) for name, policy in SYSTEMS.items()]
    again = simulate("vLLM", trace, Setup("paged", A100_SCALE), A100_OPT13B, 20.0)
    assert again.normalized_latency == runs[0].normalized_latency
    for run in runs:
        assert run.num_failed == 0 and run.num_preemptions == 0 and run.normalized_latency > 0


def test_static_batches_pay_for_padding_in_the_simulated_cost():
    requests = workload("sharegpt", 12, 2048, seed=4)
    trace = make_trace(requests, rate=50.0)
    padded = simulate("FT", trace, Setup("static", A100_SCALE), A100_OPT13B, 50.0)
    unpadded = simulate("FT", trace, Setup("static", A100_SCALE, pad_static=False), A100_OPT13B, 50.0)
    assert padded.normalized_latency > unpadded.normalized_latency


def test_step_work_and_the_roofline():
    from pagedllm.core import ScheduledSequence, SchedulerOutput
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams()
    out = SchedulerOutput(
        seqs=[
            ScheduledSequence(0, "a", list(range(100)), 0, [0], params, num_samples=1),
            ScheduledSequence(1, "b", [7], 40, [1], params, num_output_tokens=3),
        ],
        blocks_to_copy=[(2, 3)],
    )
    work = step_work(out, paged=True)
    assert (work.prefill_tokens, work.decode_seqs, work.kv_tokens_read, work.blocks_copied) == (100, 1, 141, 1)
    decode = A100_OPT13B.step_seconds(StepWork(decode_seqs=1, kv_tokens_read=100))
    assert 0.017 < decode < 0.025  # 26 GB of weights over 1.5 TB/s, plus the step overhead
    contiguous = A100_OPT13B.step_seconds(StepWork(decode_seqs=32, kv_tokens_read=32_000, paged=False))
    paged = A100_OPT13B.step_seconds(StepWork(decode_seqs=32, kv_tokens_read=32_000))
    assert paged > contiguous  # block tables cost the kernel 1 + 4/16


def test_arrivals_at_any_rate_are_one_trace_rescaled():
    slow, fast = poisson_arrivals(50, 1.0, seed=2), poisson_arrivals(50, 4.0, seed=2)
    assert fast == pytest.approx([t / 4 for t in slow])


def test_requests_that_can_never_fit_fail_instead_of_stalling_the_simulation():
    from pagedllm.bench.paper.costs import Scale
    from pagedllm.bench.paper.traces import TraceRequest

    scale = Scale(max_model_len=64, kv_slots=128, block_size=16)  # Max reserves 4 blocks per sequence
    trace = [TraceRequest(0.1 * i, [7] * 5, 8, n=4) for i in range(3)]  # 4 samples: 16 blocks > 8
    run = simulate("Orca (Max)", trace, Setup("orca-max", scale), A100_OPT13B, 10.0)
    assert run.num_failed == 3
    assert simulate("vLLM", trace, Setup("paged", scale), A100_OPT13B, 10.0).num_failed == 0


def test_a_search_runs_every_rate_through_the_runner_it_is_given():
    """The real clock's search (`real_search.py`) is the simulated one with real runs plugged in."""
    from types import SimpleNamespace

    from pagedllm.bench.paper.search import Curve, sustained_rate

    curve = Curve("vLLM", Setup("paged", A100_SCALE), requests=(([1, 2], 4),) * 1000, trace_seconds=1000)
    tried = []

    def run(c, rate):  # normalized latency grows with the rate; the bar of 1.0 is crossed at 1.0 req/s
        tried.append(rate)
        return SimpleNamespace(rate=rate, normalized_latency=rate, num_failed=0)

    result = sustained_rate(curve, None, 1.0, 0.7, factor=1.25, refinements=1, run=run, light_load_point=False)
    assert result.bracket[0] <= 1.0 <= result.bracket[1]
    assert result.sustained_rate == pytest.approx(1.0, rel=0.02)
    assert len(tried) == len(result.points) == 4  # 0.7, 0.875, 1.09 (over the bar), then one halving
