"""`pagedllm bench numerics`: the KL divergence, top-1 and perplexity math against direct
computations, llama.cpp's chunking and scored positions, the base file against a reader
written from the format's description, the summary llama-perplexity prints, and the model pass
on a tiny GGUF file against the engine's own prompt log-probabilities (and, where llama.cpp is
built, against llama-perplexity reading our base file)."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm.bench import llama_cpp_peer, llama_perplexity
from pagedllm.bench.kl_divergence import (
    PositionScores,
    chunk_inputs,
    compress_log_probs,
    decompress_log_probs,
    num_chunks,
    read_base,
    row_width,
    score_against_base,
    scored_positions,
    summarize,
    write_header,
)
from pagedllm.bench.numerics import ChunkRunner, text_tokens

# What `llama-perplexity --kl-divergence` printed (stdout, then stderr) as built here, for Gemma 3
# 270M Q4_K_M against our base file of two chunks of 512 (cut to the lines read and a few beside).
LLAMA_PERPLEXITY_OUTPUT = """\
chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p
   1      18.9688 ±    3.1582       0.00314 ±    0.00677       0.00464 ±    0.00024     1.598 ±  0.123 %    93.333 ±  1.565 %
   2      21.6696 ±    2.7233       0.00607 ±    0.00538       0.00515 ±    0.00021     1.846 ±  0.148 %    93.333 ±  1.106 %

====== Perplexity statistics ======
Mean PPL(Q)                   :  21.669627 ±   2.723306
Mean PPL(base)                :  21.538460 ±   2.705718
Cor(ln(PPL(Q)), ln(PPL(base))):  99.91%

====== KL divergence statistics ======
Mean    KLD:   0.005149 ±   0.000213
Maximum KLD:   0.043190
99.9%   KLD:   0.039670
99.0%   KLD:   0.025256
95.0%   KLD:   0.013405
Median  KLD:   0.003887

====== Token probability statistics ======
RMS Δp    :  1.846 ± 0.148 %
Same top p: 93.333 ± 1.106 %

0.04.638.039 I system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : SSE3 = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 |
0.04.781.671 I kl_divergence: computing over 2 chunks, n_ctx=512, batch_size=2048, n_seq=4
"""


# --- the math ----------------------------------------------------------------------------------

def test_kl_divergence_matches_the_closed_form_of_two_known_distributions():
    # p = softmax(0, 1, 2, 3) against the uniform q: KL(p || q) = sum p log p + log 4.
    base_logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    p = torch.softmax(base_logits, dim=-1)
    expected = float((p * p.log()).sum() + math.log(4))
    scores = score_against_base(torch.zeros(1, 4), compress_log_probs(base_logits), [2])
    assert scores.kld[0] == pytest.approx(expected, abs=2e-4)


def test_kl_divergence_matches_torch_kl_div_on_random_distributions():
    g = torch.Generator().manual_seed(0)
    base_logits = torch.randn(40, 300, generator=g) * 2  # every token within 16 of the largest
    other = base_logits + 0.3 * torch.randn(40, 300, generator=g)
    oracle = F.kl_div(torch.log_softmax(other, -1), torch.log_softmax(base_logits, -1), log_target=True,
                      reduction="none").sum(-1)
    scores = score_against_base(other, compress_log_probs(base_logits), np.zeros(40, dtype=np.int64), block=7)
    np.testing.assert_allclose(scores.kld, oracle.double().numpy(), atol=3e-4)
    assert scores.kld.mean() > 0.01  # far above the base's rounding


def test_tokens_below_the_kept_range_add_nothing_to_the_kl_divergence():
    # The base's last token is 20 below its largest: llama.cpp leaves it out of the sum, even
    # where the scored distribution puts most of its mass there.
    base_logits = torch.tensor([[0.0, 0.0, -20.0]])
    other = torch.tensor([[0.0, 0.0, 5.0]])
    scores = score_against_base(other, compress_log_probs(base_logits), [0])
    log_q = torch.log_softmax(other, -1)[0]
    expected = float(0.5 * (math.log(0.5) - log_q[0]) + 0.5 * (math.log(0.5) - log_q[1]))
    assert scores.kld[0] == pytest.approx(expected, abs=1e-3)


def test_top1_agreement_compares_the_largest_token_of_each():
    base_logits = torch.tensor([[5.0, 1.0, 0.0], [0.0, 5.0, 1.0], [0.0, 1.0, 5.0]])
    other = torch.tensor([[4.0, 1.0, 0.0], [0.0, 1.0, 5.0], [0.0, 1.0, 9.0]])  # the second row disagrees
    scores = score_against_base(other, compress_log_probs(base_logits), [0, 0, 0])
    assert scores.same_top.tolist() == [True, False, True]
    assert summarize(scores)["top1_pct"] == pytest.approx(200 / 3)


def test_negative_log_likelihoods_and_perplexities_are_those_of_the_next_tokens():
    g = torch.Generator().manual_seed(1)
    base_logits, other = torch.randn(5, 50, generator=g), torch.randn(5, 50, generator=g)
    targets = [3, 7, 0, 49, 12]
    scores = score_against_base(other, compress_log_probs(base_logits), targets)
    nll = -torch.log_softmax(other, -1)[torch.arange(5), targets].double()
    nll_base = -torch.log_softmax(base_logits, -1)[torch.arange(5), targets].double()
    np.testing.assert_allclose(scores.nll, nll.numpy(), rtol=1e-6)
    np.testing.assert_allclose(scores.nll_base, nll_base.numpy(), atol=2e-4)
    figures = summarize(scores)
    assert figures["ppl"] == pytest.approx(math.exp(nll.mean()), rel=1e-6)
    assert figures["ppl_base"] == pytest.approx(math.exp(nll_base.mean()), rel=1e-3)
    assert figures["positions"] == 5
    top1 = figures["top1_pct"] / 100
    assert figures["top1_pct_unc"] == pytest.approx(100 * math.sqrt(top1 * (1 - top1) / 4))


def test_percentiles_interpolate_between_ranks_as_llama_cpp_does():
    kld = np.random.default_rng(0).permutation(np.arange(1001) / 1000.0)  # sorted: 0, 0.001, ..., 1
    n = np.zeros(kld.size)
    figures = summarize(PositionScores(kld, np.ones(kld.size, bool), n, n))
    assert figures["kld_p99"] == pytest.approx(0.99)  # rank 0.99 * 1000 = 990 exactly
    assert figures["kld_p999"] == pytest.approx(0.999)
    assert figures["kld_max"] == 1.0 and figures["mean_kld"] == pytest.approx(0.5)
    assert figures["mean_kld_unc"] == pytest.approx(np.std(kld, ddof=0) / math.sqrt(1000))
    few = np.array([0.0, 1.0, 2.0, 10.0])  # rank 0.99 * 3 = 2.97: 2 + 0.97 * (10 - 2)
    assert summarize(PositionScores(few, np.ones(4, bool), np.zeros(4), np.zeros(4)))["kld_p99"] == pytest.approx(9.76)


def test_compressed_log_probabilities_keep_the_top_16_to_within_a_rounding_step():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 1001, generator=g) * 6  # odd vocabulary, some tokens far below
    log_p = torch.log_softmax(logits, -1)
    back = decompress_log_probs(compress_log_probs(logits), 1001)
    kept = logits > logits.max(-1, keepdim=True).values - 16
    step = 16 / 65535
    assert (back - log_p)[kept].abs().max() <= step / 2 + 1e-5
    # Below: the log-probability of a token 16 below the largest.
    floor = (logits.max(-1, keepdim=True).values - 16 - torch.logsumexp(logits, -1, keepdim=True)).expand_as(back)
    torch.testing.assert_close(back[~kept], floor[~kept], atol=1e-4, rtol=0)


# --- chunks and positions ------------------------------------------------------------------------

def test_the_second_half_of_each_chunk_is_scored_as_llama_perplexity_scores_it():
    # perplexity.cpp: first = n_ctx / 2, logits of positions first .. n_ctx - 2 (n_ctx - 1 - first of them)
    assert scored_positions(512) == range(256, 511)
    assert len(scored_positions(512)) == 255
    assert scored_positions(7) == range(3, 6)


def test_chunks_are_whole_and_begin_with_bos_where_the_vocabulary_adds_one():
    tokens = list(range(100, 123))  # 23 tokens: two whole chunks of 10, three dropped
    assert num_chunks(len(tokens), 10) == 2
    assert chunk_inputs(tokens, 10, 1, bos_token_id=None) == list(range(110, 120))
    assert chunk_inputs(tokens, 10, 1, bos_token_id=1) == [1, *range(111, 120)]
    assert tokens[10] == 110  # the text itself is left as it was


class _Tokenizer:
    """What text_tokens asks of a transformers tokenizer: a character a token, plus specials."""

    def __init__(self, bos: int | None, prefix: list[int], suffix: list[int] = ()):
        self.bos_token_id, self.prefix, self.suffix = bos, prefix, list(suffix)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = [ord(c) for c in text]
        return {"input_ids": (self.prefix + ids + self.suffix) if add_special_tokens else ids}


def test_the_text_is_tokenized_with_bos_first_only_where_the_tokenizer_adds_it():
    assert text_tokens(_Tokenizer(bos=1, prefix=[1]), "ab") == ([1, 97, 98], 1)
    assert text_tokens(_Tokenizer(bos=1, prefix=[]), "ab") == ([97, 98], None)
    with pytest.raises(ValueError, match="EOS"):
        text_tokens(_Tokenizer(bos=1, prefix=[1], suffix=[2]), "ab")


# --- the base file -------------------------------------------------------------------------------

def _read_from_the_description(path) -> dict:
    """A reader written from perplexity.cpp's format, independent of kl_divergence.read_base."""
    data = path.read_bytes()
    assert data[:8] == b"_logits_"
    n_ctx, n_vocab, n_chunk = struct.unpack_from("<Iii", data, 8)
    offset = 20
    tokens = list(struct.unpack_from(f"<{n_ctx * n_chunk}i", data, offset))
    offset += 4 * n_ctx * n_chunk
    nv = 2 * ((n_vocab + 1) // 2) + 4
    per_chunk = n_ctx - 1 - n_ctx // 2
    log_probs = []
    for _ in range(n_chunk * per_chunk):
        scale, min_log_prob = struct.unpack_from("<ff", data, offset)
        q = struct.unpack_from(f"<{n_vocab}H", data, offset + 8)
        log_probs.append([scale * v + min_log_prob for v in q])
        offset += 2 * nv
    assert offset == len(data)
    return {"n_ctx": n_ctx, "n_vocab": n_vocab, "n_chunk": n_chunk, "tokens": tokens, "log_probs": np.array(log_probs)}


def test_the_base_file_round_trips_through_a_reader_of_the_format(tmp_path):
    n_ctx, vocab = 8, 11  # odd: each row padded by one
    tokens = list(range(20))  # two whole chunks, four tokens dropped
    g = torch.Generator().manual_seed(3)
    logits = [torch.randn(len(scored_positions(n_ctx)), vocab, generator=g) * 3 for _ in range(2)]
    path = tmp_path / "base.kld"
    with open(path, "wb") as out:
        assert write_header(out, n_ctx, vocab, tokens) == 2
        for chunk_logits in logits:
            out.write(compress_log_probs(chunk_logits).tobytes())
    assert row_width(vocab) == 16
    read = _read_from_the_description(path)
    assert (read["n_ctx"], read["n_vocab"], read["n_chunk"]) == (8, 11, 2)
    assert read["tokens"] == tokens[:16]
    log_p = torch.log_softmax(torch.cat(logits), -1).numpy()
    np.testing.assert_allclose(read["log_probs"], log_p, atol=16 / 65535)
    base = read_base(path)
    assert base.tokens.tolist() == tokens[:16] and base.rows_per_chunk == 3
    np.testing.assert_allclose(decompress_log_probs(base.chunk_rows(1), vocab).numpy(), read["log_probs"][3:], atol=1e-6)


def test_a_truncated_base_file_is_refused(tmp_path):
    path = tmp_path / "base.kld"
    with open(path, "wb") as out:
        write_header(out, 8, 11, list(range(16)))
        out.write(compress_log_probs(torch.zeros(3, 11)).tobytes())  # one chunk of two
    with pytest.raises(ValueError, match="partial"):
        read_base(path)
    (tmp_path / "other").write_bytes(b"GGUF" + bytes(40))
    with pytest.raises(ValueError, match="not a llama.cpp"):
        read_base(tmp_path / "other")


# --- llama-perplexity ----------------------------------------------------------------------------

def test_the_kl_divergence_summary_is_read_from_llama_perplexity_output():
    figures = llama_perplexity.parse_kl_divergence(LLAMA_PERPLEXITY_OUTPUT)
    assert figures == {"mean_kld": 0.005149, "mean_kld_unc": 0.000213, "kld_max": 0.04319, "kld_p999": 0.03967,
                       "kld_p99": 0.025256, "top1_pct": 93.333, "top1_pct_unc": 1.106, "ppl": 21.669627,
                       "ppl_base": 21.53846, "positions": 2 * 255}
    with pytest.raises(llama_cpp_peer.LlamaCppPeerError, match="missing top1_pct"):
        llama_perplexity.parse_kl_divergence(LLAMA_PERPLEXITY_OUTPUT.replace("Same top p", "Same top"))


def test_llama_perplexity_scores_against_the_base_or_writes_its_own(tmp_path):
    (tmp_path / "llama-perplexity").write_text("")
    score = llama_perplexity.perplexity_command(tmp_path, tmp_path / "m.gguf", tmp_path / "b.kld", 512, 2)
    assert score[1:] == ["-m", str(tmp_path / "m.gguf"), "-c", "512", "-t", "2", "-tb", "2",
                         "--kl-divergence-base", str(tmp_path / "b.kld"), "--kl-divergence"]
    write = llama_perplexity.perplexity_command(tmp_path, tmp_path / "m.gguf", tmp_path / "b.kld", 512, 2,
                                              text=tmp_path / "t.txt", chunks=3)
    assert "--kl-divergence" not in write and write[-4:] == ["-f", str(tmp_path / "t.txt"), "--chunks", "3"]


# --- the model pass on a tiny GGUF file ----------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_q4_gguf(tmp_path_factory):
    """A 2-layer Llama GGUF of random Q4_1 blocks with the default model's tokenizer."""
    from pagedllm.transformers_utils import resolve_model
    from tests.gguf_writer import tokenizer_fields, write_random_llama

    path = tmp_path_factory.mktemp("numerics") / "tiny-q4_1.gguf"
    return write_random_llama(path, {"default": "Q4_1"}, hidden=256, intermediate=512, vocab=49152,
                              tokenizer=tokenizer_fields(resolve_model(None).path))


def test_the_reference_pass_gives_the_engines_own_prompt_log_probabilities(tiny_q4_gguf):
    from pagedllm import LLM, SamplingParams

    ctx = 32
    tokens = list(range(1000, 1000 + ctx))
    positions = scored_positions(ctx)
    ours = torch.log_softmax(ChunkRunner(tiny_q4_gguf, ctx, "off", step=ctx).scored_logits(tokens, positions), -1)
    llm = LLM(str(tiny_q4_gguf), kv_cache_memory=64 << 20, max_model_len=64, int8_activations="off")
    out = llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    engine = [out.prompt_logprobs[p + 1][tokens[p + 1]].logprob for p in positions]
    np.testing.assert_allclose(ours[torch.arange(len(positions)), [tokens[p + 1] for p in positions]].numpy(), engine,
                               atol=1e-4)
    # In passes of 5 tokens (a chunked prompt), the distributions are the same.
    chunked = ChunkRunner(tiny_q4_gguf, ctx, "off", step=5).scored_logits(tokens, positions)
    torch.testing.assert_close(torch.log_softmax(chunked, -1), ours, atol=1e-4, rtol=0)


def _mean_kld(runner: ChunkRunner, tokens: list[int], rows: np.ndarray) -> float:
    positions = scored_positions(runner.ctx)
    targets = tokens[positions.start + 1 : positions.stop + 1]
    return summarize(score_against_base(runner.scored_logits(tokens, positions), rows, targets))["mean_kld"]


def test_int8_passes_put_the_modes_int8_weights_on_int8_activations_at_every_step(tiny_q4_gguf):
    from pagedllm.kernels.gguf import MAX_ROWS

    # A whole-chunk pass, and the LM head over its scored positions, are past the rows that
    # "on" puts on int8 activations by itself.
    ctx = 4 * MAX_ROWS
    tokens = [1000 + (i * 7919) % 40000 for i in range(ctx)]
    reference = ChunkRunner(tiny_q4_gguf, ctx, "off", step=ctx)
    rows = compress_log_probs(reference.scored_logits(tokens, scored_positions(ctx)))
    floor = _mean_kld(reference, tokens, rows)
    assert abs(_mean_kld(ChunkRunner(tiny_q4_gguf, ctx, "off", step=MAX_ROWS), tokens, rows) - floor) < 1e-6
    on = ChunkRunner(tiny_q4_gguf, ctx, "on", step=MAX_ROWS)
    assert on.int8_weights > 0 and on.int8_plan == {f"Q4_1 up to {MAX_ROWS} rows": on.int8_weights}
    at_step = _mean_kld(on, tokens, rows)
    assert at_step > floor + 1e-5  # int8 activations moved the distributions
    # Whole chunks, the weights raised to 256 rows: the same int8 products (a row's does not
    # depend on the rows beside it), up to where float32's rounding, which differs between pass
    # sizes by 1e-5 or so, moves a value of x across an int8 rounding boundary.
    assert _mean_kld(ChunkRunner(tiny_q4_gguf, ctx, "on", step=ctx), tokens, rows) == pytest.approx(at_step, rel=0.25)


@pytest.mark.slow
def test_llama_perplexity_reads_our_base_file_on_our_tokens(tiny_q4_gguf, tmp_path):
    """Where llama.cpp is built: it scores against our reference on the positions we wrote."""
    try:
        binaries = llama_cpp_peer.built_binaries()
    except llama_cpp_peer.LlamaCppPeerError as exc:
        pytest.skip(str(exc))
    ctx, n_chunk = 64, 4  # 124 scored positions: llama-perplexity prints its summary from 100
    tokens = [1000 + (i * 7919) % 40000 for i in range(ctx * n_chunk)]
    positions = scored_positions(ctx)
    runner = ChunkRunner(tiny_q4_gguf, ctx, "off", step=ctx)
    path, parts = tmp_path / "base.kld", []
    with open(path, "wb") as out:
        write_header(out, ctx, 49152, tokens)
        for chunk in range(n_chunk):
            logits = runner.scored_logits(chunk_inputs(tokens, ctx, chunk, None), positions)
            rows = compress_log_probs(logits)
            out.write(rows.tobytes())
            first = chunk * ctx + positions.start + 1
            parts.append(score_against_base(logits, rows, tokens[first : first + len(positions)]))
    ours = summarize(PositionScores.concat(parts))
    theirs = llama_perplexity.run_kl_divergence(binaries, tiny_q4_gguf, path, ctx, 2)
    assert theirs["positions"] == ours["positions"] == n_chunk * len(positions)
    assert theirs["ppl_base"] == pytest.approx(ours["ppl_base"], rel=1e-4)  # our distributions, our positions
    assert theirs["ppl"] == pytest.approx(ours["ppl"], rel=0.02)  # the same model, run by llama.cpp
    assert theirs["top1_pct"] > 90
