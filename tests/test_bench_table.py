"""`pagedllm bench table`: a benchmark's JSON report as the manual's markdown (date, machine,
command, numbers), on reports written by real benchmark runs: the GPU check's, kept in docs/, and
one `pagedllm bench kernel` run here."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from pagedllm.bench import table
from pagedllm.bench.report import cpu_description, write_json
from pagedllm.cli import build_parser, main

GPU_CHECK = Path(__file__).resolve().parents[1] / "docs" / "gpu_check_2026-11-30"


def _table_rows(markdown: str) -> list[list[str]]:
    """The cells of each row of the markdown tables in `markdown`, header and rule left out."""
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines if not line.startswith("| ---")]


def _command(markdown: str) -> list[str]:
    line = next(line for line in markdown.splitlines() if line.startswith("Command: `"))
    return shlex.split(line.removeprefix("Command: `").removesuffix("`"))


def _assert_command_reruns_the_report(words: list[str], config: dict) -> None:
    """The command, parsed by the real CLI, gives every argument the report's run had."""
    assert words[:2] == ["pagedllm", "bench"]
    parsed = vars(build_parser().parse_args(words[1:]))
    differing = {k: (v, config[k]) for k, v in parsed.items() if k in config and k != "output_json" and v != config[k]}
    assert not differing, differing


def test_a_gpu_throughput_report_renders_with_its_date_machine_command_and_numbers():
    path = GPU_CHECK / "bench_throughput.json"
    report = json.loads(path.read_text())
    markdown = table.render(path, ["backend", "dtype", "output_tok_per_s"])
    assert markdown.startswith("2026-11-30, cpu: Intel(R) Xeon(R) Processor; flags: avx avx2 fma f16c avx_vnni ")
    assert "amx_tile; torch capability: AVX512; threads: 16." in markdown
    _assert_command_reruns_the_report(_command(markdown), report["config"])
    # The numbers as the run's log printed them (docs/gpu_check_2026-11-30/bench_throughput.log).
    assert _table_rows(markdown) == [
        ["backend", "dtype", "output_tok_per_s"], ["pagedllm", "auto", "3,556.7"], ["hf-cb", "auto", "237.3"]
    ]


def test_the_command_keeps_only_what_differs_from_the_defaults():
    words = _command(table.render(GPU_CHECK / "latency_graphs_b64.json"))
    assert words == ["pagedllm", "bench", "latency", "/tmp/gpu_models/llama-1b", "--dtype", "bfloat16",
                     "--max-model-len", "2048", "--device", "cuda", "--batch-size", "64", "--input-len", "512"]


def test_a_report_written_here_by_bench_kernel_renders(tmp_path, capsys):
    out = tmp_path / "kernel.json"
    argv = ["bench", "kernel", "--device", "cpu", "--contexts", "32", "--batches", "1", "2", "--repeats", "1",
            "--contiguous-blocks", "--output-json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    capsys.readouterr()
    assert main(["bench", "table", str(out), "--columns", "context", "batch"]) == 0
    markdown = capsys.readouterr().out
    cpu, flags = cpu_description()
    assert markdown.startswith(f"{report['time'][:10]}, cpu: {cpu}; flags: {' '.join(flags) or '-'}; ")
    words = _command(markdown)
    assert words[words.index("--batches") + 1 : words.index("--batches") + 3] == ["1", "2"]
    assert "--contiguous-blocks" in words and "--output-json" not in words
    _assert_command_reruns_the_report(words, report["config"])
    assert _table_rows(markdown) == [["context", "batch"], ["32", "1"], ["32", "2"]]


def test_a_dict_of_parts_gives_a_table_each_and_a_summary_gives_quantities(tmp_path, capsys):
    """As `bench sharing` (memory and prefix parts) and `bench serve` (one nested summary) write them."""
    sharing = write_json(tmp_path / "sharing.json", "sharing", {"command": "bench", "bench": "sharing"},
                         {"memory": [{"dataset": "alpaca", "saving_pct": 12.5}], "prefix": [{"shots": 1, "speedup": 1.5}]})
    serve = write_json(tmp_path / "serve.json", "serve", {"command": "bench", "bench": "serve", "request_rate": "inf"},
                       {"completed": 32, "ttft_ms": {"mean": 41.25, "p99": 90.0}, "errors": []})
    capsys.readouterr()
    markdown = table.render(sharing)
    assert "memory:\n\n| dataset | saving_pct |\n| --- | --- |\n| alpaca | 12.5 |" in markdown
    assert "prefix:\n\n| shots | speedup |\n| --- | --- |\n| 1 | 1.500 |" in markdown
    markdown = table.render(serve)
    assert _command(markdown) == ["pagedllm", "bench", "serve"]  # inf, the default, written as a string
    assert _table_rows(markdown) == [["quantity", "value"], ["completed", "32"], ["ttft_ms.mean", "41.2"],
                                     ["ttft_ms.p99", "90.0"], ["errors", ""]]


def test_a_file_that_is_not_a_report_is_refused_naming_it(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"runs": []}))
    with pytest.raises(ValueError, match="other.json: not a report of `pagedllm bench ...`"):
        table.render(path)


def test_the_command_writes_sizes_switches_and_lists_as_typed():
    args = build_parser().parse_args(["bench", "throughput", "--kv-cache-memory", "512MiB", "--no-enable-prefix-caching",
                                      "--batch-invariant", "--backend", "pagedllm", "hf"])
    config = {k: v for k, v in vars(args).items() if k != "func"}
    assert table.command_of(config) == ("pagedllm bench throughput --batch-invariant --kv-cache-memory 512MiB "
                                        "--no-enable-prefix-caching --backend pagedllm hf")
