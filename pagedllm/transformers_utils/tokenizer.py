"""Tokenizers through `transformers`, from the same source as the weights (imported only when a
tokenizer is built)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from pagedllm.paths import cache_dir
from pagedllm.transformers_utils.source import ModelSource

logger = logging.getLogger("pagedllm")


def get_tokenizer(source: ModelSource):
    """A `transformers` tokenizer for `source`, with its chat template and BOS/EOS ids.

    Building a tokenizer from GGUF metadata takes seconds, so the result is saved once under
    `cache_dir()` (keyed by the file's path, size and modification time) and reloaded from there.
    """
    from transformers import AutoTokenizer

    if source.kind == "hf":
        return AutoTokenizer.from_pretrained(str(source.path))
    stat = source.path.stat()
    key = hashlib.sha256(f"{source.path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_dir() / "tokenizers" / f"{source.path.stem}-{key}"
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as exc:  # a damaged cache entry: rebuild it
            logger.warning("Rebuilding cached tokenizer at %s (%s)", cached, exc)
            shutil.rmtree(cached, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(source.folder), gguf_file=source.path.name)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cached.parent))
        tokenizer.save_pretrained(str(staging))
        os.replace(staging, cached)
    except OSError as exc:  # read-only home, a concurrent writer: the cache is only an optimisation
        logger.debug("Could not cache the tokenizer at %s: %s", cached, exc)
    return tokenizer


def eos_token_ids(tokenizer, model_eos_ids: list[int]) -> list[int]:
    """The ids that end generation: the model's own, else the tokenizer's EOS."""
    ids = list(model_eos_ids)
    if not ids and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return ids
