"""Where pagedllm keeps files between runs. Imports nothing from the package and nothing heavy.

The cache folder holds what is slow to derive and cheap to keep: the compiled CPU kernels
(`kernels/`), and, for each model file, keyed by a hash of its bytes, its converted tokenizer
(`tokenizers/`), the GGUF metadata start-up needs (`gguf-metadata/`) and its weights in the
form the model computes with (`weights/`). Every entry is written whole or not at all, and an
entry that fails its checks is rebuilt; deleting the folder (or any part of it) is always safe.
"""

from __future__ import annotations

import os
from pathlib import Path

# Set to 0 (or off, false, no) to derive the tokenizer, architecture and weights from the model
# file on every start, reading and writing nothing under `cache_dir()` for models.
MODEL_CACHE_ENV = "PAGEDLLM_MODEL_CACHE"


def cache_dir() -> Path:
    """The cache folder (built kernels, converted tokenizers, model metadata and weights):
    `$PAGEDLLM_CACHE_DIR`, else `~/.cache/pagedllm`."""
    return Path(os.environ.get("PAGEDLLM_CACHE_DIR", Path.home() / ".cache" / "pagedllm"))


def model_cache_enabled() -> bool:
    """Whether what is derived from a model file is cached (`$PAGEDLLM_MODEL_CACHE`, on unless
    set to 0, off, false or no)."""
    return os.environ.get(MODEL_CACHE_ENV, "1").strip().lower() not in ("0", "off", "false", "no")
