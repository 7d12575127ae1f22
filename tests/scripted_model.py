"""A tiny Llama whose greedy output follows a script: the tests that need a model to write known
text (reasoning tags, tool calls) through the real engine, without a real model.

Every layer's output projections are zero, so the last hidden state is the current token's
embedding; each scripted token's embedding is a unit vector of its own, and the output head
gives the token it must be followed by a logit of about 80 along it (the random rest stay below
about 8). The model is a bigram table: after token `a` comes `script[a]`, whatever came before,
and after an unscripted token whatever the random weights say (a grammar's mask picks among
them). Scripted tokens are single tokens of the saved tokenizer, which may add tokens of its own.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers import tiny_hf_model

# The logit a scripted successor gets per unit of the final norm's output (sqrt(hidden) = 8).
SCRIPT_WEIGHT = 10.0


def build_scripted_model(
    path: Path, tokenizer_dir: Path, script: list[tuple[str | int, str | int]], added_tokens: list[str] = (),
    chat_template: str | None = None,
) -> Path:
    """A model folder whose greedy continuation of a token `a` is the token `b` of each pair
    `(a, b)` of `script` (token ids, or texts of one token each once `added_tokens` are added,
    not as special tokens: they stay in the decoded text)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if added_tokens:
        tokenizer.add_tokens(list(added_tokens))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    model = tiny_hf_model("llama", vocab_size=len(tokenizer))
    hidden = model.config.hidden_size
    assert len(script) <= hidden, "one embedding direction per scripted token"
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream keeps the token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for direction, (before, after) in enumerate(script):
            source, target = token_id(tokenizer, before), token_id(tokenizer, after)
            model.model.embed_tokens.weight[source] = torch.nn.functional.one_hot(torch.tensor(direction), hidden)
            model.lm_head.weight[target, direction] = SCRIPT_WEIGHT
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def token_id(tokenizer, text: str | int) -> int:
    """The id of `text`, which must be one token (as the tokenizer writes it alone or as a
    vocabulary entry, e.g. 'Ċ' for a newline); an id as it is."""
    if isinstance(text, int):
        return text
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        vocab_id = tokenizer.convert_tokens_to_ids(text)
        assert vocab_id is not None and vocab_id != tokenizer.unk_token_id, f"{text!r} is not one token: {ids}"
        return vocab_id
    return ids[0]
