"""Incremental detokenization: text that grows correctly token by token."""

from __future__ import annotations

import functools

# How many prompt tokens precede the output in the decoding window, so that the first output
# token decodes with its leading space (some tokenizers drop it at the start of a string).
_PROMPT_CONTEXT_TOKENS = 5


def backend_decoder(tokenizer):
    """The `tokenizers.Tokenizer` whose `decode(ids, skip_special_tokens=s)` is exactly
    `tokenizer.decode(ids, skip_special_tokens=s, clean_up_tokenization_spaces=False)` (a
    transformers fast tokenizer that overrides neither step), or None. Two decodes a token a
    sequence: transformers' own layers around the call (its argument conversions) cost more than
    the decode of a handful of ids."""
    return tokenizer._tokenizer if _decodes_directly(type(tokenizer)) else None


@functools.lru_cache(maxsize=None)
def _decodes_directly(kind: type) -> bool:
    try:
        from transformers import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # (an older transformers: its own decode)
        return False
    return (issubclass(kind, TokenizersBackend) and kind.decode is PreTrainedTokenizerBase.decode
            and kind._decode is TokenizersBackend._decode)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into a growing string.

    It decodes a small window of tokens and emits only the text beyond what the window's
    already-emitted part decodes to. While the newest tokens form an incomplete UTF-8 character
    (a multi-byte character split across byte tokens), nothing is emitted until it completes.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = backend_decoder(tokenizer)
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.token_ids = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""

    def fork(self) -> "IncrementalDetokenizer":
        twin = IncrementalDetokenizer.__new__(IncrementalDetokenizer)
        twin.__dict__.update(self.__dict__)
        twin.token_ids = list(self.token_ids)
        return twin

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:  # the very call tokenizer.decode ends in, without its wrapping
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def add_token(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing visible yet, or a character is still incomplete
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a sequence: emit whatever is still held back (an incomplete character
        decodes to U+FFFD, as a full decode would show it)."""
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta
