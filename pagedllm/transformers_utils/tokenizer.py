"""Tokenizers through `transformers`, from the same source as the weights (imported only when a
tokenizer is built)."""

from __future__ import annotations

import logging
from importlib.metadata import version
from pathlib import Path

from pagedllm.config import CHATML_TEMPLATE
from pagedllm.paths import cache_dir, model_cache_enabled
from pagedllm.transformers_utils.arch import gguf_metadata
from pagedllm.transformers_utils.file_cache import discard_entry, entry_key, file_digest, read_json, staged_entry
from pagedllm.transformers_utils.source import ModelSource

logger = logging.getLogger("pagedllm")


def get_tokenizer(source: ModelSource):
    """A `transformers` tokenizer for `source`, with its chat template and BOS/EOS ids.

    Building a tokenizer from GGUF metadata takes seconds, so the result is saved once under
    `cache_dir()/tokenizers` (keyed by a hash of the file's bytes and the transformers version
    that converted it) and reloaded from there.
    """
    if source.kind == "hf":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(source.path))
    return _with_default_template(_gguf_tokenizer(source), source)


def _with_default_template(tokenizer, source: ModelSource):
    """A GGUF file's tokenizer, given ChatML if the file has no chat template (llama.cpp's
    fallback), with one warning; `--chat-template` replaces it. (A model folder without one
    keeps none, as in vLLM: its chat requests are refused naming the way out.)"""
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("%s has no chat template; chat uses ChatML (llama.cpp's default). Give --chat-template "
                       "to use another.", source.path.name)
        tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _gguf_tokenizer(source: ModelSource):
    if not model_cache_enabled():
        return _from_gguf(source)
    key = entry_key(file_digest(source.path), f"transformers={version('transformers')}")
    cached = cache_dir() / "tokenizers" / f"{source.path.stem}-{key}"
    if (cached / "tokenizer_config.json").is_file():
        try:
            return _from_folder(cached)
        except Exception as exc:  # a damaged cache entry: rebuild it
            logger.warning("Rebuilding cached tokenizer at %s (%s)", cached, exc)
            discard_entry(cached)
    tokenizer = _from_gguf(source)
    try:
        with staged_entry(cached) as staging:
            tokenizer.save_pretrained(str(staging))
    except OSError as exc:  # read-only home, a full disk: the cache is only an optimisation
        logger.debug("Could not cache the tokenizer at %s: %s", cached, exc)
    return tokenizer


# The generic fast tokenizer's names: a saved tokenizer of this class needs none of
# `AutoTokenizer`'s imports (seconds, torch included) to be loaded again.
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _from_folder(folder: Path):
    config = read_json(folder / "tokenizer_config.json") or {}
    if config.get("tokenizer_class") in _GENERIC_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _from_gguf(source: ModelSource):
    """Build the tokenizer from the GGUF file's metadata, with the class `AutoTokenizer` would
    pick for the file's architecture. Not through `AutoTokenizer` itself: to pick the class it
    parses the whole file once more with gguf's slow reader (seconds)."""
    from transformers import PreTrainedTokenizerFast

    architecture = gguf_metadata(source.path)["fields"].get("general.architecture")
    try:
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

        name = TOKENIZER_MAPPING_NAMES.get(architecture)
        tokenizer_class = (tokenizer_class_from_name(name) if name else None) or PreTrainedTokenizerFast
    except ImportError:  # another transformers: the generic class serves every GGUF vocabulary
        tokenizer_class = PreTrainedTokenizerFast
    return tokenizer_class.from_pretrained(str(source.folder), gguf_file=source.path.name)


def eos_token_ids(tokenizer, model_eos_ids: list[int], end_of_turn_tokens: list[str] = ()) -> list[int]:
    """The ids that end generation: the model's own (config.json's and generation_config.json's
    `eos_token_id`, or a GGUF file's EOS/EOT ids), else the tokenizer's EOS; and the ids of
    `end_of_turn_tokens` (a GGUF family's end-of-turn texts) that the vocabulary has."""
    ids = list(model_eos_ids)
    if not ids and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    if end_of_turn_tokens:
        vocab = tokenizer.get_vocab()
        ids += [vocab[text] for text in end_of_turn_tokens if text in vocab and vocab[text] not in ids]
    return ids
