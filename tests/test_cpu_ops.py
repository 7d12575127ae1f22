"""The fused float32 CPU operators against the plain torch formulas they replace."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import ops
from pagedllm.model.layers import RMSNorm
from pagedllm.model.rotary import RotaryEmbedding


def test_loading_the_kernels_leaves_subnormal_floats_alone():
    """Built with -ffast-math but not linked with it: crtfastmath.o would turn on flush-to-zero
    for the whole process when the library loads, and torch would then compute 1e-39 / 2 as 0."""
    script = (
        "import torch\n"
        "from pagedllm.kernels import build\n"
        "build.load()\n"
        "print((torch.tensor([1e-39]) / 2).item())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert float(out) == pytest.approx(5e-40, rel=1e-3)


@pytest.mark.parametrize("rows", [1, 7, 200])  # 200 x 576 takes the multi-threaded path
def test_rms_norm_with_and_without_residual(rows):
    torch.manual_seed(rows)
    x, residual, weight = torch.randn(rows, 576), torch.randn(rows, 576) * 3, torch.randn(576)
    expected = F.rms_norm(x, (576,), weight, 1e-5)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), expected, rtol=1e-5, atol=1e-5)

    total = residual + x
    stream = residual.clone()
    out = ops.rms_norm(x, weight, 1e-5, stream)
    torch.testing.assert_close(stream, total)  # the sum is written into the residual stream
    torch.testing.assert_close(out, F.rms_norm(total, (576,), weight, 1e-5), rtol=1e-5, atol=1e-5)


def test_rms_norm_layer_fused_and_plain_paths_agree():
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6, torch.float32)
    norm.weight.data.normal_()
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    fused_out, fused_residual = norm(x, residual.clone())
    plain_residual = residual + x
    torch.testing.assert_close(fused_residual, plain_residual)
    torch.testing.assert_close(fused_out, norm._norm(plain_residual), rtol=1e-5, atol=1e-5)


def test_rotary_in_place_on_strided_rows_leaves_values_alone():
    torch.manual_seed(0)
    head_dim, heads, kv_heads = 64, 9, 3
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None, torch.float32)
    qkv = torch.randn(33, (heads + 2 * kv_heads) * head_dim)
    positions = torch.randint(0, 4096, (33,))
    qk_width = (heads + kv_heads) * head_dim
    expected = qkv.clone()
    # The rotation by hand: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin on each head's halves.
    x = expected[:, :qk_width].view(33, -1, head_dim)
    half = head_dim // 2
    cos, sin = rotary.cos[positions, :half].unsqueeze(1), rotary.sin[positions, :half].unsqueeze(1)
    x1, x2 = x[..., :half].clone(), x[..., half:].clone()
    x[..., :half], x[..., half:] = x1 * cos - x2 * sin, x2 * cos + x1 * sin

    rotary(positions, qkv[:, :qk_width])  # a strided view: rows are qkv's full width apart
    torch.testing.assert_close(qkv, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qkv[:, qk_width:], expected[:, qk_width:], rtol=0, atol=0)


def test_partial_rotary_turns_only_its_share_of_each_head():
    """Phi-4-mini's form: the first 3/4 of each head turn (by the table of that width), the rest
    and the values pass through untouched."""
    torch.manual_seed(1)
    head_dim, heads, rotary_dim = 32, 6, 24
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None, torch.float32, partial_rotary_factor=0.75)
    assert rotary.cos.shape[1] == rotary_dim
    qkv = torch.randn(9, (heads + 2) * head_dim)
    positions = torch.randint(0, 512, (9,))
    expected = qkv.clone()
    x = expected[:, : heads * head_dim].view(9, heads, head_dim)
    half = rotary_dim // 2
    cos, sin = rotary.cos[positions, :half].unsqueeze(1), rotary.sin[positions, :half].unsqueeze(1)
    x1, x2 = x[..., :half].clone(), x[..., half:rotary_dim].clone()
    x[..., :half], x[..., half:rotary_dim] = x1 * cos - x2 * sin, x2 * cos + x1 * sin

    rotary(positions, qkv[:, : heads * head_dim])  # the kernel (rows strided)
    torch.testing.assert_close(qkv, expected, rtol=1e-5, atol=1e-5)
    untouched = qkv[:, : heads * head_dim].view(9, heads, head_dim)[..., rotary_dim:]
    assert torch.equal(untouched, expected[:, : heads * head_dim].view(9, heads, head_dim)[..., rotary_dim:])
    assert torch.equal(qkv[:, heads * head_dim :], expected[:, heads * head_dim :])


@pytest.mark.parametrize("rows,dim", [(1, 2048), (3, 13), (64, 1536)])
def test_gelu_tanh_and_mul(rows, dim):
    """Gemma's gated GELU (tanh form): torch's formula computed in float64 (torch's float32
    0.5 x (1 + tanh u) itself loses digits where tanh u nears -1), to float32 rounding, across
    the saturated ends and near 0."""
    torch.manual_seed(dim)
    x = torch.randn(rows, 2 * dim) * 4
    x[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -20.0, 1e-6, -1e-6])
    gate, up = x.double().chunk(2, dim=-1)
    expected = (F.gelu(gate, approximate="tanh") * up).float()
    assert ops.has_gated_kernel("gelu_pytorch_tanh", x) and not ops.has_gated_kernel("gelu", x)
    torch.testing.assert_close(ops.gated_activation(x, "gelu_pytorch_tanh"), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,dim", [(1, 1536), (3, 13), (64, 1536)])
def test_silu_and_mul(rows, dim):
    torch.manual_seed(dim)
    x = torch.randn(rows, 2 * dim) * 4
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0])  # saturated ends of the sigmoid
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("vocab", [5, 49152, 1003])  # short rows, whole 8-wide blocks, a ragged tail
def test_logsumexp_rows_matches_torch(vocab):
    torch.manual_seed(vocab)
    x = torch.randn(6, vocab) * 4
    x[2, : vocab // 2] = float("-inf")  # masked tokens
    torch.testing.assert_close(ops.logsumexp_rows(x), torch.logsumexp(x, dim=-1, keepdim=True), rtol=1e-5, atol=1e-5)
    strided = torch.randn(3, 2 * vocab)[:, ::2]  # rows read through a stride
    torch.testing.assert_close(ops.logsumexp_rows(strided), torch.logsumexp(strided, dim=-1, keepdim=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab", [5, 49152, 1003])
def test_logsumexp_and_argmax_rows_match_torch(vocab):
    torch.manual_seed(vocab)
    x = torch.randn(7, vocab) * 4
    x[1, : vocab // 2] = float("-inf")  # masked tokens
    x[2, [vocab // 3, vocab - 1]] = 100.0  # a tie: the first of the two wins, as in torch
    x[3, vocab - 1] = 100.0  # the maximum in the ragged tail past the 8-wide blocks
    x[4] = float("-inf")  # every token masked
    x[5, vocab // 2] = float("nan")  # a broken row: torch's answer
    log_norm, argmax = ops.logsumexp_and_argmax_rows(x)
    torch.testing.assert_close(log_norm, torch.logsumexp(x, dim=-1, keepdim=True), rtol=1e-5, atol=1e-5, equal_nan=True)
    assert argmax.tolist() == x.argmax(dim=-1).tolist()
    assert argmax[2] == vocab // 3 and argmax[3] == vocab - 1


@pytest.mark.parametrize("vocab", [5, 1003, 262144])
def test_greedy_rows_is_the_argmax_and_its_log_probability_as_torch_gives_them(vocab):
    """The sampler's one-call greedy step: each row's torch.argmax and x[argmax] - logsumexp(x),
    bitwise the normaliser's subtraction (a row holding NaN: torch's argmax, the first NaN; an
    all-masked row: token 0 and NaN)."""
    torch.manual_seed(vocab)
    x = torch.randn(5, vocab) * 4
    x[1, [vocab // 3, vocab - 1]] = 100.0  # a tie: the first wins
    x[2] = float("-inf")
    x[3, [vocab // 2, vocab - 1]] = float("nan")
    x[4, : vocab // 2] = float("-inf")
    token_ids, logprobs = ops.greedy_rows(x)
    assert token_ids == x.argmax(dim=-1).tolist()
    assert token_ids[3] == vocab // 2 and token_ids[2] == 0
    log_norm, argmax = ops.logsumexp_and_argmax_rows(x)
    expected = (x.gather(1, argmax.unsqueeze(1)) - log_norm).squeeze(1)
    torch.testing.assert_close(torch.tensor(logprobs), expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(torch.tensor(logprobs), torch.log_softmax(x.double(), dim=-1).gather(
        1, argmax.unsqueeze(1)).squeeze(1).float(), rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("threads", [2, 3])
def test_a_single_long_row_split_among_threads_matches_torch(threads):
    """One sequence over a 262,144-token vocabulary (Gemma's): its columns' parts are shared among
    the threads; the normaliser and greedy token are torch's, ties across parts, masked parts, an
    all-masked row and NaN included."""
    vocab = 262144
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cases = []
        for seed in range(6):
            torch.manual_seed(seed)
            cases.append(torch.randn(1, vocab) * 4)
        cases[1][0, [vocab // 5, vocab - 3]] = 50.0  # a tie in different parts: the first wins
        cases[2][0, : 2 * vocab // 3] = float("-inf")  # whole parts masked
        cases[3][0] = float("-inf")
        cases[4][0, vocab - 1] = 50.0  # the maximum in the last part's tail
        cases[5][0, vocab // 2] = float("nan")
        for x in cases:
            log_norm, argmax = ops.logsumexp_and_argmax_rows(x)
            torch.testing.assert_close(log_norm, torch.logsumexp(x, dim=-1, keepdim=True), rtol=1e-5, atol=1e-5,
                                       equal_nan=True)
            assert argmax.tolist() == x.argmax(dim=-1).tolist()
            torch.testing.assert_close(ops.logsumexp_rows(x), log_norm, rtol=0, atol=0, equal_nan=True)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("vocab", [49152, 262144, 70001])
def test_a_rows_normaliser_is_bitwise_the_same_in_any_batch_at_any_thread_count(vocab):
    """Batch-invariant mode's log-probabilities: a row's normaliser and greedy token do not
    depend on how many rows come with it or how many threads share them (a long row alone is cut
    among the threads, rows of a batch go a thread each: the parts and their order are the same)."""
    torch.manual_seed(vocab)
    batch = torch.randn(5, vocab) * 4
    previous = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            whole = ops.logsumexp_and_argmax_rows(batch)
            for r in range(batch.shape[0]):
                alone = ops.logsumexp_and_argmax_rows(batch[r : r + 1].clone())
                results.append((alone[0].item(), alone[1].item()))
                results.append((whole[0][r].item(), whole[1][r].item()))
            results.append(tuple(ops.logsumexp_rows(batch[1:3]).flatten().tolist()))
            results.append(tuple(ops.logsumexp_rows(batch).flatten().tolist()[1:3]))
    finally:
        torch.set_num_threads(previous)
    for r in range(batch.shape[0]):  # every thread count, alone and in the batch: one answer a row
        assert len({results[t * (2 * batch.shape[0] + 2) + 2 * r + k] for t in range(3) for k in (0, 1)}) == 1
    assert len({results[t * (2 * batch.shape[0] + 2) + 2 * batch.shape[0] + k] for t in range(3) for k in (0, 1)}) == 1


@pytest.mark.parametrize("vocab", [7, 4096, 1003, 70001])  # (70,001: nine parts of 8,192 columns)
def test_sample_rows_inverts_the_cumulative_distribution(vocab):
    """At each uniform u, the kernel's token is the first whose cumulative probability exceeds
    u (what searchsorted on the torch cumsum gives), up to float rounding at interval edges."""
    gen = torch.Generator().manual_seed(vocab)
    rows = 64
    x = torch.randn(rows, vocab, generator=gen) * 3
    x[::4, 1::2] = float("-inf")  # every fourth row: odd tokens masked
    temperature = torch.linspace(0.3, 2.0, rows)
    uniform = torch.rand(rows, generator=gen)
    tokens = ops.sample_rows(x, temperature, uniform)
    cdf = torch.softmax(x.double() / temperature.double().unsqueeze(1), dim=-1).cumsum(-1)
    expected = torch.searchsorted(cdf, uniform.double().unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
    # Where the two disagree, u sits within float rounding of an interval edge.
    for r in torch.nonzero(tokens != expected).flatten().tolist():
        edge = cdf[r, min(int(tokens[r]), int(expected[r]))] / cdf[r, -1]
        assert abs(float(edge) - float(uniform[r])) < 1e-5, (r, int(tokens[r]), int(expected[r]))
    assert (tokens[::4] % 2 == 0).all()  # masked tokens are never drawn
    assert (tokens != expected).float().mean() < 0.05


@pytest.mark.parametrize("vocab", [49152, 262144])
def test_a_rows_draw_is_the_same_in_any_batch_at_any_thread_count(vocab):
    """A row is cut into fixed parts whatever its batch and the threads, so its draw at a given
    uniform does not move (a lone row's parts are shared among the threads)."""
    gen = torch.Generator().manual_seed(vocab)
    batch = torch.randn(5, vocab, generator=gen) * 0.5  # flat: a rounding moves the draw by tokens
    batch[2, : vocab // 2] = float("-inf")  # whole parts without weight
    temperature, uniform = torch.tensor([0.7, 1.0, 1.3, 0.9, 2.0]), torch.tensor([0.1, 0.5, 0.97, 0.0, 0.6])
    previous = torch.get_num_threads()
    draws = set()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            whole = ops.sample_rows(batch, temperature, uniform).tolist()
            alone = [int(ops.sample_rows(batch[r : r + 1].clone(), temperature[r : r + 1], uniform[r : r + 1]))
                     for r in range(5)]
            draws.add(tuple(whole))
            draws.add(tuple(alone))
    finally:
        torch.set_num_threads(previous)
    assert len(draws) == 1, draws
    assert min(draws.pop()[2:3]) >= vocab // 2


def test_sample_rows_extremes_of_the_uniform_stay_on_allowed_tokens():
    x = torch.full((2, 50), float("-inf"))
    x[0, 10], x[0, 20] = 0.0, 0.0  # two equally likely tokens, the rest masked
    x[1, 49] = 1.0
    low = ops.sample_rows(x, torch.ones(2), torch.zeros(2))
    high = ops.sample_rows(x, torch.ones(2), torch.full((2,), 1 - 2**-24))
    assert low.tolist() == [10, 49] and high.tolist() == [20, 49]
    long = torch.full((1, 70001), float("-inf"))  # allowed tokens in the first, a middle and the last part
    long[0, [10, 30000, 69999]] = 0.0
    ends = [int(ops.sample_rows(long, torch.ones(1), torch.tensor([u]))) for u in (0.0, 0.5, 1 - 2**-24)]
    assert ends == [10, 30000, 69999]


# bfloat16: the kernels round where a bfloat16 model run by transformers rounds (after each torch
# operator), so they are checked against transformers' own modules and formulas in bfloat16.
# Allowed: a different last bit in a few values, where float32 sums in another order (the norm's
# mean) or a polynomial exp (SiLU) land on the other side of a rounding boundary.


def _assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor, max_fraction_off: float) -> None:
    assert actual.dtype == expected.dtype == torch.bfloat16 and actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    # Values below 1e-30 count as zero (SiLU far below -87, whose exp the kernel clamps).
    tiny = (actual.float().abs() < 1e-30) & (expected.float().abs() < 1e-30)
    bits_a, bits_e = actual.view(torch.int16).int(), expected.view(torch.int16).int()
    off = (bits_a != bits_e) & ~tiny
    assert (bits_a - bits_e)[~tiny].abs().max().item() <= 1, "a value differs by more than its last bit"
    assert off.float().mean().item() <= max_fraction_off, f"{off.sum().item()} of {off.numel()} values differ"


@pytest.mark.parametrize("rows", [1, 7, 200])
def test_bf16_rms_norm_matches_transformers(rows):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(rows)
    hf = LlamaRMSNorm(576, eps=1e-5).to(torch.bfloat16)
    hf.weight.data.normal_()
    x, residual = torch.randn(rows, 576).bfloat16(), (torch.randn(rows, 576) * 3).bfloat16()
    with torch.no_grad():
        _assert_bf16_close(ops.rms_norm(x, hf.weight.data, 1e-5), hf(x), 0.002)
        total = residual + x  # transformers adds the residual in bfloat16
        stream = residual.clone()
        out = ops.rms_norm(x, hf.weight.data, 1e-5, stream)
        assert torch.equal(stream, total)
        _assert_bf16_close(out, hf(total), 0.002)


def test_bf16_rotary_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    head_dim, heads, kv_heads, tokens = 64, 9, 3, 33
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None, torch.bfloat16)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).bfloat16()
    positions = torch.randint(0, 4096, (tokens,))
    q = qkv[:, : heads * head_dim].view(1, tokens, heads, head_dim).transpose(1, 2)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(1, tokens, kv_heads, head_dim).transpose(1, 2)
    cos, sin = rotary.cos[positions].unsqueeze(0), rotary.sin[positions].unsqueeze(0)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    values = qkv[:, (heads + kv_heads) * head_dim :].clone()

    qk_width = (heads + kv_heads) * head_dim
    rotary(positions, qkv[:, :qk_width])
    assert torch.equal(qkv[:, : heads * head_dim], expected_q.transpose(1, 2).reshape(tokens, -1))
    assert torch.equal(qkv[:, heads * head_dim : qk_width], expected_k.transpose(1, 2).reshape(tokens, -1))
    assert torch.equal(qkv[:, qk_width:], values)


@pytest.mark.parametrize("rows,dim", [(1, 1536), (3, 13), (64, 1536)])
def test_bf16_silu_and_mul_matches_torch(rows, dim):
    torch.manual_seed(dim)
    x = (torch.randn(rows, 2 * dim) * 4).bfloat16()
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0])  # saturated ends of the sigmoid
    gate, up = x.chunk(2, dim=-1)
    _assert_bf16_close(ops.silu_and_mul(x), F.silu(gate) * up, 0.002)
