"""The embedded SmolLM2 (Q4_1 GGUF) through pagedllm against transformers loading the same file.
Every engine here runs on float32 activations (`int8_activations="off"`; `smollm_llm` too): the
mode whose greedy output is transformers', whatever the default."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from tests.helpers import hf_greedy

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
]
PLAIN = ["The theory of relativity states that", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def chat_prompts(smollm_llm):
    return [smollm_llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def expected(smollm_hf, smollm_llm, chat_prompts):
    tokenizer = smollm_llm.get_tokenizer()
    prompts = chat_prompts + [tokenizer.encode(p) for p in PLAIN]
    return prompts, [hf_greedy(smollm_hf, p, 32) for p in prompts]


def test_greedy_matches_transformers_token_for_token(smollm_llm, expected):
    prompts, reference = expected
    outputs = smollm_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    tokenizer = smollm_llm.get_tokenizer()
    for o in outputs:
        assert o.outputs[0].text == tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True)
    assert "Paris" in outputs[0].outputs[0].text


def test_greedy_matches_under_preemption(expected):
    prompts, reference = expected
    # 9 blocks of 16 tokens: one prompt plus its answer fits, all six together do not.
    llm = LLM(max_model_len=128, num_gpu_blocks=9, swap_space=0, int8_activations="off")
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert stats.num_free_blocks == stats.num_total_blocks


def test_beam_search_matches_transformers(smollm_llm, smollm_hf, chat_prompts):
    import torch

    from pagedllm import BeamSearchParams

    prompts = chat_prompts[:2]
    results = smollm_llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=16))
    eos = smollm_llm.llm_engine.eos_token_ids[0]
    for prompt, result in zip(prompts, results):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = smollm_hf.generate(
                ids, attention_mask=torch.ones_like(ids), num_beams=3, num_return_sequences=3,
                do_sample=False, max_new_tokens=16, pad_token_id=0,
            )
        expected = []
        for row in out.tolist():
            generated = row[len(prompt):]
            expected.append(generated[: generated.index(eos) + 1] if eos in generated else generated)
        assert [s.tokens[len(prompt):] for s in result.sequences] == expected


def test_bfloat16_keeps_greedy_answers_sensible(expected):
    prompts, reference = expected
    llm = LLM(max_model_len=512, kv_cache_memory=64 << 20, dtype="bfloat16", int8_activations="off")
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert "Paris" in outputs[0].outputs[0].text
    # Rounding may make long continuations drift, but the first tokens agree with float32.
    first_tokens_agree = sum(o.outputs[0].token_ids[:4] == ref[:4] for o, ref in zip(outputs, reference))
    assert first_tokens_agree >= len(prompts) - 1
