"""The top-k / top-p / min-p draw in one pass of the row (`ops.sample_filtered_rows`,
csrc/sampling_filtered.cpp) against a float64 reference written here from the filters'
definitions, and the sampler's draws against its torch path (sort, mask, cumulative sum)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import ops
from pagedllm.sampling import Sampler
from pagedllm.sampling import sampler as sampler_module
from pagedllm.sampling_params import SamplingParams
from tests.test_sampling import item


def reference(x: torch.Tensor, t: float, k: int, p: float, min_p: float) -> tuple[list[int], torch.Tensor]:
    """The tokens the filters keep (in vocabulary order) and their cumulative probabilities
    (float64): top-k keeps z >= the k-th largest z; top-p, over those from the largest z (ties:
    the lower id first), each token while the probability before it is below p; min-p, of those,
    each token whose probability is at least min_p times the largest's."""
    z = (x / t).double()  # (the division in float32, as the sampler does it)
    kept = torch.isfinite(z)
    if 0 < k < len(z):
        kth = torch.sort(z, descending=True).values[k - 1]
        kept &= z >= kth
    if p < 1.0:
        order = torch.sort(torch.where(kept, z, -torch.inf), descending=True, stable=True).indices
        ids = order[: int(kept.sum())]
        weights = torch.exp(z[ids] - z[ids[0]])
        before = (torch.cumsum(weights, 0) - weights) / weights.sum()
        kept[:] = False
        kept[ids[before < p]] = True
    if min_p > 0.0:
        weights = torch.exp(z - z[kept].max())
        kept &= weights >= min_p
    ids = torch.nonzero(kept).flatten()
    weights = torch.exp(z[ids] - z[ids].max())
    return ids.tolist(), torch.cumsum(weights, 0) / weights.sum()


def check_draws(x: torch.Tensor, t: float, k: int, p: float, min_p: float, draws: int = 400) -> set[int]:
    """At `draws` uniforms across [0, 1), the kernel's token is the reference's (the first kept
    token whose cumulative probability exceeds u), save within float rounding of an interval's
    edge. Returns the tokens drawn."""
    ids, cdf = reference(x, t, k, p, min_p)
    u = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws
    rows = x.unsqueeze(0).expand(draws, -1)
    got = ops.sample_filtered_rows(rows, torch.full((draws,), t), [k] * draws, [p] * draws, [min_p] * draws, u.float())
    at = torch.searchsorted(cdf, u, right=True).clamp(max=len(ids) - 1)
    expected = torch.tensor(ids)[at]
    for i in torch.nonzero(got != expected).flatten().tolist():
        assert float((cdf - u[i]).abs().min()) < 1e-5, (i, float(u[i]), int(got[i]), int(expected[i]))
    assert set(got.tolist()) <= set(ids)
    return set(got.tolist())


def logits(vocab: int, scale: float, seed: int) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("vocab", [1000, 49_152])
@pytest.mark.parametrize(
    "t, k, p, min_p",
    [
        (1.0, 40, 1.0, 0.0),  # top-k alone
        (0.7, 0, 0.9, 0.0),  # top-p alone
        (1.3, 0, 1.0, 0.05),  # min-p alone
        (0.8, 40, 0.95, 0.0),  # llama.cpp's top-k then top-p
        (0.8, 40, 0.95, 0.05),  # and min-p
        (3.0, 0, 0.5, 0.2),
        (1.0, 5000, 1.0, 0.0),  # more than the heap's first try
    ],
)
def test_each_filter_and_their_chain_draw_as_the_reference(vocab, t, k, p, min_p):
    drawn = check_draws(logits(vocab, 3.0, vocab + k), t, k, p, min_p)
    assert len(drawn) > 1


@pytest.mark.parametrize("scale", [0.05, 1.0, 6.0])  # flat (top-p needs nearly every token), middling, peaked
def test_top_p_finds_its_cut_however_far_down_the_row(scale):
    """Top-p alone sums the weights in buckets of z and sorts only the bucket where the mass
    reaches p: a flat row puts thousands of tokens in it, a peaked one a few."""
    x = logits(49_152, scale, 7)
    drawn = check_draws(x, 1.0, 0, 0.9, 0.0, draws=300)
    ids, _ = reference(x, 1.0, 0, 0.9, 0.0)
    assert len(ids) > (20_000 if scale == 0.05 else 0)
    assert len(drawn) >= min(len(ids), 300) // 2


def test_top_p_cut_far_below_the_largest():
    """Ten likely tokens and 100,000 tokens 10 nats down holding as much mass again: top-p 0.9
    cuts among the far ones, past the first buckets looked at (8 nats)."""
    x = torch.full((100_010,), -10.0) + torch.rand(100_010, generator=torch.Generator().manual_seed(1)) * 0.01
    x[:10] = 0.0
    ids, _ = reference(x, 1.0, 0, 0.9, 0.0)
    assert 10 < len(ids) < 100_000
    drawn = check_draws(x, 1.0, 0, 0.9, 0.0, draws=200)
    assert any(j >= 10 for j in drawn) and any(j < 10 for j in drawn)


def test_masked_tokens_ties_and_a_k_past_the_vocabulary():
    x = logits(4096, 2.0, 3)
    x[1::2] = float("-inf")  # odd tokens forbidden (a grammar, logit_bias)
    x[[10, 20, 30, 40]] = x.max() + 1.0  # four tokens tied for the top
    drawn = check_draws(x, 1.0, 2, 1.0, 0.0)  # top-2 keeps every token tied at the 2nd largest
    assert drawn == {10, 20, 30, 40}
    assert all(j % 2 == 0 for j in check_draws(x, 0.9, 0, 0.8, 0.01))
    assert all(j % 2 == 0 for j in check_draws(x, 1.0, 100_000, 1.0, 0.0))
    tied = torch.full((1000,), float("-inf"))
    tied[100:200] = 5.0  # a hundred equally likely tokens: top-p 0.5 keeps the fifty of lower id
    ids, _ = reference(tied, 1.0, 0, 0.5, 0.0)
    assert ids == list(range(100, 150))
    assert check_draws(tied, 1.0, 0, 0.5, 0.0) == set(range(100, 150))
    assert check_draws(tied, 1.0, 30, 0.5, 0.0) == set(range(100, 150))  # (top-k keeps all tied at its k-th)
    everything_masked = torch.full((1, 64), float("-inf"))
    one = torch.ones(1)
    assert ops.sample_filtered_rows(everything_masked, one, [5], [0.9], [0.1], torch.tensor([0.3])).tolist() == [0]


def test_rows_of_a_batch_keep_their_own_filters():
    """Each row's draw in a batch of mixed filters (and threads) is its draw alone."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(6, 3000, generator=gen) * 4
    t = torch.tensor([0.5, 1.0, 1.5, 0.8, 1.0, 2.0])
    k, p, m = [0, 50, 0, 40, 3, 0], [0.9, 1.0, 1.0, 0.95, 0.7, 0.99], [0.0, 0.0, 0.1, 0.05, 0.0, 0.0]
    u = torch.rand(6, generator=gen)
    batch = ops.sample_filtered_rows(x, t, k, p, m, u)
    alone = [int(ops.sample_filtered_rows(x[r : r + 1], t[r : r + 1], k[r : r + 1], p[r : r + 1], m[r : r + 1], u[r : r + 1]))
             for r in range(6)]
    assert batch.tolist() == alone


def test_the_sampler_draws_as_its_torch_path(monkeypatch):
    """The sampler's filtered draws (seeded) are those of its torch path: filter_top_k_top_p_min_p
    (a full sort), then the cumulative distribution."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 5000, generator=gen) * 5
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=1), SamplingParams(temperature=1.0, top_p=0.9, seed=2),
              SamplingParams(temperature=1.2, min_p=0.05, seed=3), SamplingParams(temperature=0.7, seed=4)]
    runs = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(sampler_module.fused_ops, "applies", lambda x: False)
        sampler = Sampler()
        runs[fused] = [[s[0].token_id for s in sampler(x.clone(), [item(q, request_id=f"r{i}") for i, q in enumerate(params)])]
                       for _ in range(100)]
    assert runs[True] == runs[False]
    assert len({tuple(r) for r in runs[True]}) > 1  # the draws vary from step to step


def test_a_row_without_filters_draws_alike_beside_rows_with_them():
    """A row that filters nothing is drawn by the plain kernel whatever its neighbours ask: on a
    flat row of 262,144 tokens the two kernels' running sums (float, double) differ by a token or
    so at the draw."""
    x = torch.randn(2, 262_144, generator=torch.Generator().manual_seed(2)) * 0.01
    plain = SamplingParams(temperature=1.0, seed=9)
    filtered = SamplingParams(temperature=1.0, top_p=0.9, seed=8)
    alone_sampler, beside_sampler = Sampler(), Sampler()
    alone = [alone_sampler(x[1:].clone(), [item(plain, request_id="b")])[0][0].token_id for _ in range(100)]
    beside = [beside_sampler(x.clone(), [item(filtered, request_id="a"), item(plain, request_id="b")])[1][0].token_id
              for _ in range(100)]
    assert beside == alone
    assert len(set(alone)) > 50  # (100 steps of the seeded stream: different draws)


@pytest.mark.parametrize("vocab", [1000, 262_144])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_top_logprobs_in_one_pass_equal_torchs(vocab, k):
    """The k most likely tokens with their log-probabilities, and the chosen token's rank, as
    torch.topk over row - log_norm and a count give them (the sampling package's top_logprobs)."""
    from pagedllm.sampling.sampler import top_logprobs

    gen = torch.Generator().manual_seed(vocab + k)
    x = torch.randn(4, vocab, generator=gen) * 3
    x[1, ::3] = float("-inf")  # masked tokens
    log_norm = torch.logsumexp(x, dim=-1, keepdim=True)
    chosen = torch.tensor([int(x[0].argmax()), 5, vocab - 1, int(x[3].topk(3).indices[2])])
    values, ids, ranks = ops.top_logprobs_rows(x, log_norm, chosen, k)
    for r in range(4):
        expected = top_logprobs(x[r], log_norm[r], int(chosen[r]), k)
        got = {t: (v, rank) for rank, (t, v) in enumerate(zip(ids[r].tolist(), values[r].tolist()), start=1)}
        mine = int(chosen[r])
        if mine not in got:
            got[mine] = ((x[r, mine] - log_norm[r]).item(), int(ranks[r]))
        assert got == expected, r
        assert int(ranks[r]) == expected[mine][1]


def test_the_sampler_reports_logprobs_as_its_torch_path(monkeypatch):
    x = torch.randn(3, 4000, generator=torch.Generator().manual_seed(1)) * 3
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0.8, logprobs=0, seed=3),
              SamplingParams(temperature=1.0, top_p=0.9, logprobs=20, seed=4)]
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(sampler_module.fused_ops, "applies", lambda x: False)
        out = Sampler()(x.clone(), [item(q, request_id=f"r{i}") for i, q in enumerate(params)])
        runs.append([(s[0].token_id, s[0].logprob, s[0].top_logprobs) for s in out])
    assert runs[0] == runs[1]
    assert [len(top) for _, _, top in runs[0]][0] in (5, 6) and all(top for _, _, top in runs[0])
