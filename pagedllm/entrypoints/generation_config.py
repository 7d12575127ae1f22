"""Default sampling from a model's `generation_config.json`, as vLLM's `--generation-config` does:
a request (or `LLM.generate` without `SamplingParams`) that leaves a field unset gets the model
author's value instead of the library's."""

from __future__ import annotations

import json
from pathlib import Path

# generation_config.json keys -> SamplingParams fields (the ones vLLM takes from it).
_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# What each field would be without a generation config: such values are no defaults to report.
_LIBRARY_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}


def default_sampling(generation_config: str, model: str) -> dict:
    """SamplingParams fields from the generation config: `"auto"` reads the model folder's
    `generation_config.json` (none: no defaults), `"vllm"` ignores it, anything else is a folder
    that must hold one."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        path = _model_folder(model) / "generation_config.json"
        if not path.is_file():
            return {}
    else:
        path = Path(generation_config).expanduser() / "generation_config.json"
        if not path.is_file():
            raise ValueError(
                f"generation_config: {path} does not exist; give 'auto' (the model folder's), 'vllm' (none) "
                "or a folder holding a generation_config.json."
            )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"generation_config: cannot read {path}: {exc}") from None
    return sampling_fields(config, f"generation_config: {{key}} in {path}", skip_library_defaults=True)


def sampling_fields(config: dict, where: str, skip_library_defaults: bool = False) -> dict:
    """SamplingParams fields from generation_config.json's keys; `where` names a bad value's
    place (formatted with `key`)."""
    defaults = {}
    for key, field in _SAMPLING_KEYS.items():
        value = config.get(key) if isinstance(config, dict) else None
        if value is None or skip_library_defaults and value == _LIBRARY_DEFAULTS.get(key):
            continue
        integral = field in ("top_k", "max_tokens")
        if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
            kind = "an integer" if integral else "a number"
            raise ValueError(f"{where.format(key=key)} must be {kind}, got {value!r}.")
        defaults[field] = value
    return defaults


def _model_folder(model: str) -> Path:
    """The folder a model name or path stands for (the default model's package holds no
    generation config: its GGUF file's folder is as good as none)."""
    path = Path(model).expanduser()
    return path.parent if path.is_file() else path
