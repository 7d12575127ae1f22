"""Tokenizers from GGUF (cached after the first build) and incremental detokenization."""

from __future__ import annotations

import pytest

from pagedllm.transformers_utils import IncrementalDetokenizer, get_tokenizer, resolve_model

TRICKY_TEXT = "Hello 世界! Ünïcödé 🙂👍🏽 naïve café — 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ok\n  done"


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(resolve_model(None))


def test_incremental_detokenization_matches_full_decode_with_split_characters(tokenizer):
    prompt = tokenizer.encode("Say something:")
    output = tokenizer.encode(TRICKY_TEXT)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    texts, held_back = [], 0
    for token in output:
        delta = detok.add_token(token)
        held_back += delta == ""
        assert "\ufffd" not in detok.text  # never shows half a character
        texts.append(detok.text)
    assert detok.text == tokenizer.decode(output)
    assert "".join(texts[-1]) == TRICKY_TEXT
    assert held_back > 0, "the text should contain characters split across byte tokens"
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "text only grows"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_the_backends_decode_is_the_tokenizers_own(tokenizer, skip_special_tokens):
    """The detokenizer calls the Rust tokenizer directly (transformers' wrapping costs more than
    the decode): every window it decodes reads as tokenizer.decode reads it, special tokens,
    split characters and leading spaces included."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": TRICKY_TEXT}], add_generation_prompt=True)
    ids = list(getattr(ids, "input_ids", ids))
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens)
    assert detok._backend is not None  # the default model's tokenizer takes the direct call
    for start in range(0, len(ids), 3):
        for end in (start + 1, start + 4, start + 9):
            window = ids[start:end]
            assert detok._decode(window) == tokenizer.decode(window, skip_special_tokens=skip_special_tokens,
                                                             clean_up_tokenization_spaces=False)


def test_a_tokenizer_that_decodes_its_own_way_keeps_its_decode(tokenizer):
    class Shouting(type(tokenizer)):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    shouting = Shouting.__new__(Shouting)
    shouting.__dict__.update(tokenizer.__dict__)
    detok = IncrementalDetokenizer(shouting, [])
    assert detok._backend is None
    for token in tokenizer.encode("quiet words"):
        detok.add_token(token)
    assert detok.text == "QUIET WORDS"


def test_detokenizer_fork_is_independent(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"))
    for t in tokenizer.encode(" one"):
        detok.add_token(t)
    twin = detok.fork()
    for t in tokenizer.encode(" two"):
        twin.add_token(t)
    assert detok.text == " one" and twin.text == " one two"


def test_flush_emits_an_incomplete_character_as_a_full_decode_would(tokenizer):
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [])
    detok.add_token(ids[0])
    assert detok.text == ""
    detok.flush()
    assert detok.text == tokenizer.decode(ids[:1])


def test_tokenizer_has_chat_template_and_special_ids(tokenizer):
    assert tokenizer.eos_token_id == 2
    assert tokenizer.bos_token_id == 1
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_tokenizer_cache_reproduces_the_gguf_tokenizer(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    source = resolve_model(None)
    fresh = get_tokenizer(source)  # built from the GGUF metadata, then saved
    saved = list((tmp_path / "tokenizers").iterdir())
    assert len(saved) == 1 and (saved[0] / "tokenizer_config.json").is_file()
    cached = get_tokenizer(source)
    for text in (TRICKY_TEXT, "def f(x):\n    return x**2", "   leading spaces"):
        assert cached.encode(text) == fresh.encode(text) == tokenizer.encode(text)
    assert cached.chat_template == fresh.chat_template
    assert (cached.bos_token_id, cached.eos_token_id) == (fresh.bos_token_id, fresh.eos_token_id)
