"""Where pagedllm keeps files between runs. Imports nothing from the package and nothing heavy."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache folder (built kernels, converted tokenizers): `$PAGEDLLM_CACHE_DIR`, else
    `~/.cache/pagedllm`."""
    return Path(os.environ.get("PAGEDLLM_CACHE_DIR", Path.home() / ".cache" / "pagedllm"))
