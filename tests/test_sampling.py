"""The sampler on hand-made logits, and SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.core.scheduler_output import ScheduledSequence
from pagedllm.sampling import Sampler, filter_top_k_top_p_min_p
from pagedllm.sampling_params import SamplingParams


def item(params: SamplingParams, request_id: str = "r", output: list[int] | None = None, prompt: list[int] | None = None, **kw):
    params.all_stop_token_ids = set(params.stop_token_ids) | ({2} if not params.ignore_eos else set())
    return ScheduledSequence(
        seq_id=0,
        request_id=request_id,
        token_ids=[0],
        start_position=0,
        block_table=[0],
        sampling_params=params,
        num_output_tokens=len(output or []),
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        **kw,
    )


def test_greedy_takes_argmax_and_reports_raw_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    (samples,) = Sampler()(logits, [item(SamplingParams(temperature=0))])
    assert samples[0].token_id == 1
    assert math.isclose(samples[0].logprob, torch.log_softmax(logits, -1)[0, 1].item(), rel_tol=1e-6)


def test_top_k_top_p_min_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda **kw: torch.isfinite(filter_top_k_top_p_min_p(logits, **kw)[0]).tolist()  # noqa: E731
    assert kept(top_k=[2], top_p=[1.0], min_p=[0.0]) == [True, True, False, False]
    # top_p keeps the smallest set whose mass reaches p: 0.5 + 0.3 >= 0.8
    assert kept(top_k=[0], top_p=[0.8], min_p=[0.0]) == [True, True, False, False]
    assert kept(top_k=[0], top_p=[0.81], min_p=[0.0]) == [True, True, True, False]
    assert kept(top_k=[0], top_p=[0.01], min_p=[0.0]) == [True, False, False, False]
    # min_p: keep tokens with p >= min_p * p_max = 0.25
    assert kept(top_k=[0], top_p=[1.0], min_p=[0.5]) == [True, True, False, False]


def test_random_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = torch.log(probs).unsqueeze(0).repeat(4000, 1)
    params = SamplingParams(temperature=1.0)
    samples = Sampler(seed=1)(logits, [item(params, request_id=str(i)) for i in range(4000)])
    counts = torch.bincount(torch.tensor([s[0].token_id for s in samples]), minlength=4).float() / 4000
    assert torch.allclose(counts, probs, atol=0.03)
    assert counts[3] == 0


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[2.0, 1.0, 0.0]]).repeat(3000, 1)

    def share_of_top(t: float) -> float:
        samples = Sampler(seed=2)(logits, [item(SamplingParams(temperature=t), str(i)) for i in range(3000)])
        return sum(s[0].token_id == 0 for s in samples) / 3000

    assert share_of_top(0.3) > share_of_top(1.0) > share_of_top(3.0)


def test_seeded_request_is_independent_of_its_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def draw(rows, index):
        sampler = Sampler(seed=99)
        items = [item(SamplingParams(temperature=1.0), request_id=f"other{i}") for i in range(len(rows))]
        items[index] = item(seeded, request_id="seeded")
        tokens = []
        for _ in range(20):  # the generator's state carries across steps
            tokens.append(sampler(rows, items)[index][0].token_id)
        return tokens

    alone = draw(logits[2:3], 0)
    in_batch = draw(logits[[0, 1, 2, 3]], 2)
    assert alone == in_batch
    assert len(set(alone)) > 1  # it is really sampling


def test_penalties_discourage_repeats():
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5]])
    base = SamplingParams(temperature=0)
    assert Sampler()(logits, [item(base, output=[0])])[0][0].token_id == 0
    assert Sampler()(logits, [item(SamplingParams(temperature=0, presence_penalty=0.5), output=[0])])[0][0].token_id == 1
    assert Sampler()(logits, [item(SamplingParams(temperature=0, frequency_penalty=0.2), output=[0])])[0][0].token_id == 1
    # Repetition penalty divides positive logits (2.0 -> 1.0) of prompt and output tokens.
    assert Sampler()(logits, [item(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[0])])[0][0].token_id == 1
    # ...and multiplies negative ones, pushing them further down.
    neg = torch.tensor([[-1.0, -1.5, -5.0]])
    assert Sampler()(neg, [item(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[0])])[0][0].token_id == 1


@pytest.mark.parametrize("repetition, frequency, presence", [(1.3, 0.0, 0.0), (1.0, 0.4, 0.0), (1.0, 0.0, 0.7), (0.8, -0.3, 1.1)])
def test_penalties_equal_their_whole_row_formulas(repetition, frequency, presence):
    """The penalties touch only the tokens seen, and give bitwise what the whole-row formulas
    give: transformers' RepetitionPenaltyLogitsProcessor over prompt and output tokens, then
    logit - frequency * count - presence * (count > 0) over output tokens (OpenAI's)."""
    from pagedllm.sampling.penalties import apply_penalties
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(4)
    vocab = 5000
    logits = torch.randn(3, vocab, generator=gen) * 4
    logits[:, 7] = 0.0
    outputs = [[7, 7, 9, 9, 9, 4999, 5003], [], [1, 2, 3, 2, 1]]  # (5003: an id past the vocabulary, ignored)
    prompts = [[9, 11, 7, 5004], [100, 200, 100], []]
    params = SamplingParams(temperature=1.0, repetition_penalty=repetition, frequency_penalty=frequency,
                            presence_penalty=presence)
    got = apply_penalties(logits, [item(params, output=o, prompt=q) for o, q in zip(outputs, prompts)])
    for r, (output, prompt) in enumerate(zip(outputs, prompts)):
        row = logits[r : r + 1].clone()
        seen = torch.tensor([t for t in prompt + output if t < vocab], dtype=torch.long)
        if repetition != 1.0 and len(seen):
            row = RepetitionPenaltyLogitsProcessor(repetition)(seen.unsqueeze(0), row)
        counts = torch.bincount(torch.tensor([t for t in output if t < vocab], dtype=torch.long), minlength=vocab).float()
        row = row - frequency * counts - presence * (counts > 0).float()
        assert torch.equal(got[r], row[0]), r


def test_min_tokens_suppresses_eos_and_stop_tokens():
    logits = torch.tensor([[0.0, 0.0, 5.0, 4.0, 1.0]])  # 2 is EOS
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[3])
    assert Sampler()(logits, [item(params, output=[4])])[0][0].token_id == 4
    assert Sampler()(logits, [item(params, output=[4, 4, 4])])[0][0].token_id == 2


def test_logprobs_hold_top_k_and_the_chosen_token_with_ranks():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    expected = torch.log_softmax(logits, -1)[0]
    params = SamplingParams(temperature=0, logprobs=2)
    (samples,) = Sampler()(logits, [item(params)])
    top = samples[0].top_logprobs
    assert set(top) == {1, 2}
    assert top[1][1] == 1 and top[2][1] == 2
    assert math.isclose(top[2][0], expected[2].item(), rel_tol=1e-6)
    # A sampled token outside the top-k is added with its rank.
    params = SamplingParams(temperature=0, logprobs=1, min_tokens=1, stop_token_ids=[1], ignore_eos=True)
    (samples,) = Sampler()(logits, [item(params, output=[])])
    assert samples[0].token_id == 2 and samples[0].top_logprobs[2][1] == 2


def test_parallel_prompt_row_expands_into_best_of_seeded_streams():
    logits = torch.randn(1, 30)
    params = SamplingParams(n=3, temperature=1.0, seed=5)
    expanded = Sampler()(logits, [item(params, num_samples=3)])[0]
    assert len(expanded) == 3
    # Sample i equals what a lone sequence with sample_index i draws.
    for i in range(3):
        alone = Sampler()(logits, [item(params, sample_index=i)])[0][0]
        assert alone.token_id == expanded[i].token_id


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"temperature": 0, "n": 2}, "n"),  # n was sent, not best_of
        ({"temperature": 0, "best_of": 2}, "best_of"),
        ({"seed": 2**64}, "seed"),  # never wrapped to 0
        ({"seed": -1}, "seed"),
        ({"use_beam_search": True, "best_of": 1}, "best_of"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"use_beam_search": True, "n": 2, "temperature": 0, "length_penalty": float("nan")}, "length_penalty"),
        ({"use_beam_search": True, "n": 2, "temperature": 0, "length_penalty": float("inf")}, "length_penalty"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}|{field}"):
        SamplingParams(**kwargs)


def test_top_k_minus_one_means_disabled_and_stop_string_becomes_list():
    params = SamplingParams(top_k=-1, stop="###")
    assert params.top_k == 0 and params.stop == ["###"]


def test_a_plain_greedy_batch_takes_the_fast_path_and_gets_the_general_paths_tokens(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 49152, generator=gen) * 4
    items = [item(SamplingParams(temperature=0), request_id=f"r{i}") for i in range(5)]
    fast = Sampler()(logits.clone(), items)
    general_calls = []
    apply = __import__("pagedllm.sampling.sampler", fromlist=["apply_token_controls"]).apply_token_controls
    monkeypatch.setattr("pagedllm.sampling.sampler.apply_token_controls",
                        lambda raw, rows: general_calls.append(len(rows)) or apply(raw, rows))
    assert Sampler()(logits.clone(), items) == fast and general_calls == []  # (the fast path: no controls looked at)
    expected = torch.log_softmax(logits, -1)
    for r, (sample,) in enumerate(fast):
        assert sample.token_id == int(logits[r].argmax()) and sample.top_logprobs is None
        assert math.isclose(sample.logprob, expected[r, sample.token_id].item(), rel_tol=1e-5, abs_tol=1e-6)
    # the general path on the same rows gives the very same tokens and log-probabilities
    monkeypatch.setattr("pagedllm.sampling.sampler._plain_greedy", lambda it: False)
    assert Sampler()(logits.clone(), items) == fast and general_calls == [5]


@pytest.mark.parametrize("change", ["logprobs", "logit_bias", "repetition_penalty", "min_tokens", "temperature"])
def test_one_row_that_is_not_plain_greedy_takes_the_batch_the_general_way(change):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 1000, generator=gen) * 0.01  # near-flat rows ...
    logits[:, 2] = 0.05  # ... whose argmax is token 2 (EOS), by less than a penalty of 2 leaves it
    params = {"logprobs": {"logprobs": 2}, "logit_bias": {"logit_bias": {5: 100.0}},
              "repetition_penalty": {"repetition_penalty": 2.0}, "min_tokens": {"min_tokens": 4},
              "temperature": {"temperature": 1.0}}[change]
    plain = [item(SamplingParams(temperature=0), request_id=f"p{i}") for i in range(2)]
    other = item(SamplingParams(**{"temperature": 0, "seed": 3, **params}), request_id="o", prompt=[2], output=[9])
    (*plain_samples, (sample,)) = Sampler()(logits.clone(), [*plain, other])
    assert [s[0].token_id for s in plain_samples] == [2, 2]
    if change == "logprobs":  # listed: only the general path lists them
        assert sample.token_id == 2 and sample.top_logprobs is not None
    elif change == "logit_bias":
        assert sample.token_id == 5
    else:  # penalised, suppressed (EOS before min_tokens) or drawn from 1000 near-equal tokens: not the argmax
        assert sample.token_id != 2
