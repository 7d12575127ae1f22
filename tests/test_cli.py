"""The `pagedllm` command: generate, errors, and the throughput benchmark's table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.bench.datasets import PROFILES, sample_requests
from pagedllm.cli import main


def test_generate_prints_the_engine_output(tiny_llama, capsys):
    code = main(["generate", "--model", str(tiny_llama), "Hello world", "--max-tokens", "6", "--max-model-len", "128"])
    assert code == 0
    printed = capsys.readouterr().out
    expected = LLM(str(tiny_llama), max_model_len=128).generate("Hello world", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert printed == "Hello world" + expected[0].outputs[0].text + "\n"


def test_bad_engine_argument_is_a_clear_error(tiny_llama, capsys):
    code = main(["generate", "--model", str(tiny_llama), "hi", "--block-size", "0"])
    assert code == 2
    assert "block_size must be a positive integer" in capsys.readouterr().err


def test_cli_entry_point_is_installed():
    result = subprocess.run([sys.executable, "-m", "pagedllm.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for command in ("generate", "chat", "demo", "bench"):
        assert command in result.stdout


def test_datasets_have_the_paper_means_and_are_reproducible():
    for name, profile in PROFILES.items():
        requests = sample_requests(name, 4000, max_model_len=4096, vocab_size=1000, seed=0)
        mean_in = sum(len(r.prompt_token_ids) for r in requests) / len(requests)
        mean_out = sum(r.output_len for r in requests) / len(requests)
        # Clipping to the context trims the tails a little.
        assert 0.85 * profile.mean_input < mean_in < 1.1 * profile.mean_input
        assert 0.85 * profile.mean_output < mean_out < 1.1 * profile.mean_output
    a = sample_requests("sharegpt", 5, 4096, 1000, seed=3)
    assert a == sample_requests("sharegpt", 5, 4096, 1000, seed=3)
    short = sample_requests("sharegpt", 200, max_model_len=256, vocab_size=1000)
    assert all(len(r.prompt_token_ids) + r.output_len <= 256 for r in short)


def test_bench_throughput_writes_table_and_json(tiny_llama, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(
        ["bench", "throughput", str(tiny_llama), "--num-prompts", "4", "--backend", "pagedllm", "pagedllm-invariant",
         "hf", "hf-cb", "--max-model-len", "128", "--output-json", str(out)]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "output_tok_per_s" in table and "x_vs_hf" in table and "x_vs_hf-cb" in table and "x_vs_pagedllm" in table
    payload = json.loads(out.read_text())
    rows = {r["backend"]: r for r in payload["results"]}
    requests = sample_requests("sharegpt", 4, 128, 49152)
    expected_tokens = sum(r.output_len for r in requests)
    assert rows["pagedllm"]["output_tokens"] == rows["hf"]["output_tokens"] == rows["hf-cb"]["output_tokens"] == expected_tokens
    assert rows["pagedllm"]["requests"] == 4 and rows["pagedllm"]["output_tok_per_s"] > 0
    # The batch-invariant mode's cost, measured in the same run.
    assert rows["pagedllm-invariant"]["output_tokens"] == expected_tokens
    assert rows["pagedllm-invariant"]["batch_invariant"] and not rows["pagedllm"]["batch_invariant"]
    assert rows["pagedllm-invariant"]["x_vs_pagedllm"] > 0


def test_bench_sharing_reports_savings_and_prefix_speedup(tiny_llama, tmp_path, capsys):
    out = tmp_path / "sharing.json"
    code = main(
        ["bench", "sharing", str(tiny_llama), "--datasets", "alpaca", "--num-prompts", "2", "--widths", "2",
         "--max-output-len", "8", "--prefix-shots", "2", "--prefix-requests", "4", "--max-model-len", "512",
         "--kv-cache-memory", "32MiB",
         "--output-json", str(out)]
    )
    assert code == 0
    assert "saving_pct" in capsys.readouterr().out
    results = json.loads(out.read_text())["results"]
    by_method = {r["method"]: r for r in results["memory"]}
    for row in by_method.values():
        assert row["blocks_shared"] < row["blocks_unshared"] and row["preemptions"] == 0
    assert by_method["beam width=2"]["saving_pct"] > by_method["parallel n=2"]["saving_pct"]
    (prefix,) = results["prefix"]
    assert prefix["prefix_tokens"] == 136 and prefix["hit_rate_on"] > 0.5


def test_bench_preemption_runs_each_mode_and_block_size(tiny_llama, tmp_path, capsys):
    out = tmp_path / "preemption.json"
    code = main(
        ["bench", "preemption", str(tiny_llama), "--dataset", "sharegpt", "--num-prompts", "12", "--block-sizes", "1", "16",
         "--kv-tokens", "512", "--max-model-len", "512", "--swap-space", "0.01", "--output-json", str(out)]
    )
    assert code == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["block_size"], r["mode"]) for r in rows] == [(b, m) for b in (1, 16) for m in ("recompute", "swap", "auto")]
    for row in rows:
        assert row["preemptions"] > 0
        if row["mode"] == "recompute":
            assert row["blocks_swapped"] == 0 and row["recomputed_tokens"] > 0
        if row["mode"] == "swap":
            assert row["blocks_swapped"] > 0 and row["swap_preemptions"] > 0


def test_bench_kernel_latency_and_dtype_write_results(tiny_llama, tmp_path):
    kernel_json, latency_json, dtype_json = tmp_path / "k.json", tmp_path / "l.json", tmp_path / "d.json"
    assert main(["bench", "kernel", "--contexts", "64", "300", "--batches", "1", "4", "--repeats", "1",
                 "--output-json", str(kernel_json)]) == 0
    rows = json.loads(kernel_json.read_text())["results"]
    assert [(r["context"], r["batch"]) for r in rows] == [(64, 1), (64, 4), (300, 1), (300, 4)]
    assert all(r["paged_ms"] > 0 and r["sdpa_ms"] > 0 and r["reference_ms"] > 0 for r in rows)
    assert main(["bench", "latency", str(tiny_llama), "--max-model-len", "256", "--input-len", "20", "--output-len", "8",
                 "--num-iters", "2", "--output-json", str(latency_json)]) == 0
    rows = json.loads(latency_json.read_text())["results"]
    assert len(rows) == 2 and all(r["ttft_ms"] > 0 and r["tpot_ms"] > 0 and r["roofline_pct"] > 0 for r in rows)
    assert main(["bench", "dtype", str(tiny_llama), "--max-model-len", "256", "--num-tokens", "4",
                 "--dtypes", "float32", "bfloat16", "float32+int8", "--output-json", str(dtype_json)]) == 0
    rows = {r["dtype"]: r for r in json.loads(dtype_json.read_text())["results"]["rows"]}
    assert rows["float32"]["agree_pct"] == 100 and 0 <= rows["bfloat16"]["agree_pct"] <= 100
    # A safetensors model has no quantized blocks, so int8 activations change nothing there.
    assert rows["float32+int8"]["agree_pct"] == 100


def test_grounded_requests_copy_pagedllm_functions_and_are_as_long_as_the_copy(tokenizer_dir):
    from transformers import AutoTokenizer

    from pagedllm.bench.spec import grounded_messages, grounded_requests

    messages = grounded_messages(12, seed=1)
    assert messages == grounded_messages(12, seed=1) and messages != grounded_messages(12, seed=2)
    sources = [code for _, code in messages]
    assert len(set(sources)) == 12  # each function once before any repeats
    for message, code in messages:
        assert code.startswith("def ") and code in message  # the answer copies the message's source
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    requests = grounded_requests(tokenizer, 12, 4096, seed=1)
    for request, (message, code) in zip(requests, messages):
        assert request.output_len == len(tokenizer.encode(code, add_special_tokens=False)) + 16
        assert tokenizer.decode(request.prompt_token_ids).count(code.splitlines()[0]) == 1
    room = 600
    short = grounded_requests(tokenizer, 12, room, seed=1)
    assert all(len(r.prompt_token_ids) + r.output_len <= room for r in short)
    with pytest.raises(ValueError, match="--max-model-len"):
        grounded_requests(tokenizer, 12, 64, seed=1)


def test_bench_throughput_grounded_runs_with_and_without_speculation(tiny_llama, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(
        ["bench", "throughput", str(tiny_llama), "--dataset", "grounded", "--num-prompts", "3", "--temperature", "0",
         "--backend", "pagedllm-nospec", "pagedllm", "--max-model-len", "1024",
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": false}',
         "--output-json", str(out)]
    )
    assert code == 0
    assert "x_vs_pagedllm-nospec" in capsys.readouterr().out
    rows = {r["backend"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["pagedllm"]["output_tokens"] == rows["pagedllm-nospec"]["output_tokens"] > 3 * 16
    assert rows["pagedllm-nospec"]["spec_draft_tokens"] == 0
    # Adaptive off and 1-token matches: every earlier occurrence of the last token is verified (the
    # grounded prompts quote pagedllm's own functions, so whether a random model repeats a longer
    # n-gram changed with the code they quote).
    assert rows["pagedllm"]["spec_draft_tokens"] > 0
    assert rows["pagedllm"]["x_vs_pagedllm-nospec"] > 0


@pytest.mark.parametrize(
    "argv, unknown",
    [
        (["serve", "--ctx", "512"], "--ctx"),  # a prefix of llama-server's --ctx-size (-t was once read as -tp)
        (["serve", "--max-num", "4"], "--max-num"),  # an abbreviation of --max-num-seqs
        (["generate", "hi", "--max-tok", "5"], "--max-tok"),
        (["bench", "latency", "--batch", "2"], "--batch"),
    ],
)
def test_options_match_only_as_spelled(argv, unknown, capsys):
    """No argparse prefix matching in any subcommand: a prefix of an option is refused by name."""
    from pagedllm.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    assert f"unrecognized arguments: {unknown}" in capsys.readouterr().err


def test_options_spelled_in_full_still_parse():
    from pagedllm.cli import build_parser

    args = build_parser().parse_args(["serve", "-tp", "2", "--max-num-seqs", "4", "--max-model-len=128"])
    assert (args.tensor_parallel_size, args.max_num_seqs, args.max_model_len) == (2, 4, 128)
