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


def test_the_real_search_covers_all_five_systems_from_their_simulated_rates(monkeypatch, tmp_path):
    """`--real-search` (real_search.py) searches vLLM, the three Orcas and static batching, each
    from its simulated rate (static batching's without the padding the real engine never
    computes), and finds the rate where each system's real latency crosses the bar."""
    from types import SimpleNamespace

    from pagedllm.bench.paper import real_search
    from pagedllm.bench.paper.context import Context
    from pagedllm.bench.paper.profiles import get_profile
    from pagedllm.bench.paper.search import Pool

    capacity = {"vLLM": 1.0, "Orca (Oracle)": 0.7, "Orca (Pow2)": 0.55, "Orca (Max)": 0.4, "FasterTransformer": 0.2}
    simulated = {s: 1.1 * c for s, c in capacity.items()}  # the simulation 10% optimistic
    tried: dict[str, list[float]] = {s: [] for s in capacity}
    setups = {}

    def real_run(engine, curve, rate):  # latency 2 (the bar) exactly at the system's capacity
        tried[curve.system].append(rate)
        setups[curve.system] = curve.setup
        latency = 2 * rate / capacity[curve.system]
        return SimpleNamespace(rate=rate, normalized_latency=latency, num_failed=0, as_dict=lambda: {"rate": rate})

    monkeypatch.setattr(real_search, "build_engine", lambda *a, **k: SimpleNamespace(shutdown=lambda: None))
    monkeypatch.setattr(real_search, "real_run_at", real_run)
    monkeypatch.setattr(real_search, "unloaded_latency", lambda ctx, curve, run=None: 1.0)
    monkeypatch.setattr(real_search, "sustained", lambda ctx, dataset, system: simulated[system])
    monkeypatch.setattr(real_search, "sustained_rate", _simulated_ft_or_real(real_search.sustained_rate, simulated))
    ctx = Context(get_profile("a100-opt13b", tmp_path), "real", tmp_path, Pool(1), requests_override=40)
    result = real_search.real_sustained_rates(ctx)
    assert set(result["systems"]) == set(capacity)
    assert not setups["FasterTransformer"].pad_static
    for system, found in result["systems"].items():
        assert tried[system][0] == pytest.approx(simulated[system])  # started where the simulation said
        assert found["sustained_rate"] == pytest.approx(capacity[system], rel=0.03)
        assert len(tried[system]) == 2  # over the bar at the start, under it one 1.25x step down
    # written as each system's search ends: the same answer
    saved = json.loads((tmp_path / f"real_search_{ctx.tag}.json").read_text())
    assert saved["systems"]["FasterTransformer"]["sustained_rate"] == result["systems"]["FasterTransformer"]["sustained_rate"]


def _simulated_ft_or_real(search, simulated):
    """real_search's sustained_rate: the simulated search of static batching's unpadded curve
    (cost given) answers the stubbed simulated rate; the real searches (no cost) run as they are."""
    from types import SimpleNamespace

    def wrapped(curve, cost, *args, **kwargs):
        if cost is not None:
            assert curve.system == "FasterTransformer" and not curve.setup.pad_static
            return SimpleNamespace(sustained_rate=simulated[curve.system])
        return search(curve, cost, *args, **kwargs)

    return wrapped


def test_the_real_search_reuses_the_validation_runs_of_the_same_rates(monkeypatch, tmp_path):
    """`--figures 12 --real-search` after `--figures 12` in the same folder does not run the
    validation again when its rates are the same; at other rates it does."""
    from pagedllm.bench.paper import real_figures
    from pagedllm.bench.paper.context import Context
    from pagedllm.bench.paper.profiles import get_profile
    from pagedllm.bench.paper.search import Pool

    monkeypatch.setattr(real_figures, "sustained", lambda ctx, dataset, system="vLLM": 1.0)
    ctx = Context(get_profile("a100-opt13b", tmp_path), "real", tmp_path, Pool(1), requests_override=40, real_search=True)
    rate = real_figures.COMMON_RATE_SHARE * 1.0
    data = {d: {"rate": rate, "systems": {"vLLM": [{"mark": d}]}} for d in ("sharegpt", "alpaca")}
    (tmp_path / f"fig12_{ctx.tag}.json").write_text(json.dumps({"results": {"data": data}}))
    monkeypatch.setattr(real_figures, "build_engine", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran again")))
    assert real_figures.real_runs(ctx) == data
    other = Context(ctx.profile, "real", tmp_path, Pool(1), requests_override=40, real_search=True)
    monkeypatch.setattr(real_figures, "sustained", lambda ctx, dataset, system="vLLM": 2.0)
    with pytest.raises(AssertionError, match="ran again"):
        real_figures.real_runs(other)
