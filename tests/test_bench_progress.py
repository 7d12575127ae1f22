"""Long benchmarks say how far they got: a line per phase and at most one per 10 s within it,
on stderr (stdout carries the tables and JSON paths scripts read)."""

from __future__ import annotations

import io
import json

from pagedllm.bench.progress import Progress
from pagedllm.cli import main


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_within_a_phase_is_said_at_most_once_per_interval():
    clock, out = Clock(), io.StringIO()
    progress = Progress("bench serve", every_s=10, stream=out, clock=clock)
    progress.phase("sending 40 requests")
    said = []
    for second in range(1, 36):  # updated every second: a line at 10, 20 and 30 s only
        clock.now = second
        if progress.update(second, 40, "requests done", "5 output tokens"):
            said.append(second)
    assert said == [10, 20, 30]
    lines = out.getvalue().splitlines()
    assert lines[0] == "bench serve: sending 40 requests..."
    assert lines[1] == "bench serve: 10/40 requests done (10 s, about 30 s left); 5 output tokens"
    assert len(lines) == 4


def test_a_long_phase_says_its_end_and_a_short_one_does_not():
    clock, out = Clock(), io.StringIO()
    progress = Progress("bench x", every_s=10, stream=out, clock=clock)
    progress.phase("short")
    clock.now = 3
    assert not progress.update(5, 5)  # done in 3 s: the next phase's line says enough
    progress.phase("long")
    clock.now = 25
    assert progress.update(5, 5, "requests done")
    assert out.getvalue().splitlines() == ["bench x: short...", "bench x: long...", "bench x: 5/5 requests done (22 s)"]


def test_the_lines_go_to_stderr_never_stdout(capsys):
    progress = Progress("bench y")
    progress.phase("warm-up")
    captured = capsys.readouterr()
    assert captured.err == "bench y: warm-up...\n" and captured.out == ""


def test_bench_latency_says_its_phases_on_stderr_and_keeps_stdout_for_results(tiny_llama, tmp_path, capsys):
    path = tmp_path / "latency.json"
    assert main(["bench", "latency", str(tiny_llama), "--max-model-len", "256", "--input-len", "16", "--output-len", "4",
                 "--num-iters", "1", "--num-gpu-blocks", "64", "--preemption-mode", "recompute",
                 "--output-json", str(path)]) == 0
    captured = capsys.readouterr()
    phases = [line for line in captured.err.splitlines() if line.startswith("bench latency: ")]
    assert phases[:3] == ["bench latency: starting the engine...", "bench latency: measuring the matrix-product rate...",
                          "bench latency: warm-up..."]
    assert phases[3].startswith("bench latency: iteration 1/1: a batch of 1")
    assert "bench latency:" not in captured.out and f"wrote {path}" in captured.out
    assert json.loads(path.read_text())["results"]
