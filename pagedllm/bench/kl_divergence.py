"""Next-token distributions compared as llama.cpp's `llama-perplexity --kl-divergence` compares
them, on the same positions and in the same file format, so that pagedllm's figures and
llama.cpp's are computed alike (tools/perplexity/perplexity.cpp of the vendored llama.cpp).

The text is split into chunks of `n_ctx` tokens (the whole token list, BOS first where the
vocabulary adds one; the tokens past the last whole chunk are dropped). Each chunk runs alone
from position 0, its first token replaced by BOS where the vocabulary adds one. The logits of
positions `n_ctx // 2` ... `n_ctx - 2` are scored, each against the token that follows it:
`n_ctx - 1 - n_ctx // 2` positions a chunk, so that every scored position has at least half a
chunk of context.

The base file (`--kl-divergence-base FILE`, written by a run without `--kl-divergence`), all
little-endian:

    "_logits_"                       8 bytes
    n_ctx                            uint32
    n_vocab, n_chunk                 int32, int32
    tokens                           int32 [n_chunk * n_ctx], the chunks as tokenized (no BOS put in)
    per chunk, per scored position:  uint16 [nv], nv = 2 * ceil(n_vocab / 2) + 4
        the first 4 uint16 are two float32: scale, min_log_prob
        then n_vocab uint16 q (and one of padding where n_vocab is odd):
        log p(token) = scale * q + min_log_prob

A row keeps the log-probabilities within 16 of the largest logit, quantized over 65535 steps
(a step of 2.4e-4 at most); the tokens below that range get q = 0. Scoring a distribution
against a row (`score_against_base`): KL(base || other) summed over the tokens whose base
log-probability is above -16, top-1 agreement (the first largest index of each), and both
negative log-likelihoods of the next token.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MAGIC = b"_logits_"
# Log-probabilities further than this below the largest are stored as the row's minimum.
LOG_PROB_RANGE = 16.0
HEADER_BYTES = len(MAGIC) + 12


def scored_positions(n_ctx: int) -> range:
    """The positions of a chunk whose logits are scored (each predicts the token after it)."""
    return range(n_ctx // 2, n_ctx - 1)


def num_chunks(num_tokens: int, n_ctx: int) -> int:
    """Whole chunks of `n_ctx` tokens in the text (llama.cpp needs at least two)."""
    return num_tokens // n_ctx


def chunk_inputs(tokens: list[int], n_ctx: int, chunk: int, bos_token_id: int | None) -> list[int]:
    """The tokens the model runs for `chunk`: its `n_ctx` tokens of the text, the first replaced
    by BOS where the vocabulary adds one (`bos_token_id` given)."""
    inputs = list(tokens[chunk * n_ctx : (chunk + 1) * n_ctx])
    if bos_token_id is not None:
        inputs[0] = bos_token_id
    return inputs


def row_width(n_vocab: int) -> int:
    """uint16 values a scored position takes: two float32s and the vocabulary, padded to even."""
    return 2 * ((n_vocab + 1) // 2) + 4


def compress_log_probs(logits: torch.Tensor) -> np.ndarray:
    """Rows of logits [n, vocab] -> base-file rows [n, row_width(vocab)] uint16, as llama.cpp
    writes them (float32 arithmetic, the sum of exponentials in float64, rounding to nearest)."""
    logits = logits.float()
    n, vocab = logits.shape
    max_logit = logits.max(dim=-1, keepdim=True).values
    min_logit = torch.maximum(logits.min(dim=-1, keepdim=True).values, max_logit - LOG_PROB_RANGE)
    log_sum_exp = (logits - max_logit).exp().double().sum(dim=-1, keepdim=True).log().float()
    min_log_prob = min_logit - max_logit - log_sum_exp
    scale = (max_logit - min_logit) / 65535.0
    inv_scale = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.where(logits > min_logit, torch.round(inv_scale * (logits - min_logit)), torch.zeros_like(logits))
    rows = np.zeros((n, row_width(vocab)), dtype=np.uint16)
    rows[:, :4] = torch.cat([scale, min_log_prob], dim=-1).numpy().astype(np.float32).view(np.uint16)
    rows[:, 4 : 4 + vocab] = q.numpy().astype(np.uint16)
    return rows


def decompress_log_probs(rows: np.ndarray, n_vocab: int) -> torch.Tensor:
    """Base-file rows [n, nv] -> the log-probabilities they hold, float32 [n, n_vocab]."""
    rows = np.ascontiguousarray(rows)
    header = torch.from_numpy(rows[:, :4].copy().view(np.float32))  # [n, 2]: scale, min_log_prob
    q = torch.from_numpy(rows[:, 4 : 4 + n_vocab].astype(np.float32))
    return header[:, :1] * q + header[:, 1:2]


def write_header(out: io.BufferedWriter, n_ctx: int, n_vocab: int, tokens: list[int]) -> int:
    """The file's header and token list for every whole chunk of `tokens`; returns the chunks."""
    n_chunk = num_chunks(len(tokens), n_ctx)
    out.write(MAGIC + struct.pack("<Iii", n_ctx, n_vocab, n_chunk))
    out.write(np.asarray(tokens[: n_chunk * n_ctx], dtype="<i4").tobytes())
    return n_chunk


@dataclass
class BaseFile:
    """A KL-divergence base file opened for reading (`read_base`); `chunk_rows(i)` maps chunk i's
    rows [n_ctx - 1 - n_ctx // 2, nv] without reading the rest."""

    path: Path
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray  # int32 [n_chunk * n_ctx]

    @property
    def rows_per_chunk(self) -> int:
        return len(scored_positions(self.n_ctx))

    def chunk_rows(self, chunk: int) -> np.ndarray:
        if not 0 <= chunk < self.n_chunk:
            raise IndexError(f"chunk {chunk} of a base file of {self.n_chunk} chunks")
        nv = row_width(self.n_vocab)
        start = HEADER_BYTES + 4 * self.tokens.size + 2 * chunk * self.rows_per_chunk * nv
        return np.memmap(self.path, dtype="<u2", mode="r", offset=start, shape=(self.rows_per_chunk, nv))


def read_base(path: str | Path) -> BaseFile:
    """Open a base file, checking its magic and that its size is what its header says."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or head[: len(MAGIC)] != MAGIC:
            raise ValueError(f"{path} is not a llama.cpp KL-divergence base file (no {MAGIC!r} header)")
        n_ctx, n_vocab, n_chunk = struct.unpack("<Iii", head[len(MAGIC) :])
        tokens = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype="<i4")
    base = BaseFile(path, n_ctx, n_vocab, n_chunk, tokens)
    expected = HEADER_BYTES + 4 * tokens.size + 2 * n_chunk * base.rows_per_chunk * row_width(n_vocab)
    if tokens.size != n_ctx * n_chunk or path.stat().st_size != expected:
        raise ValueError(f"{path} holds {path.stat().st_size} bytes where its header ({n_chunk} chunks of {n_ctx}, "
                         f"{n_vocab} tokens) needs {expected}: a partial or foreign file")
    return base


@dataclass
class PositionScores:
    """Per scored position: KL(base || other), whether both put the same token first, and the
    next token's negative log-likelihood under each."""

    kld: np.ndarray  # float64 [n]
    same_top: np.ndarray  # bool [n]
    nll: np.ndarray  # float64 [n], the scored distribution's
    nll_base: np.ndarray  # float64 [n], the base's

    @staticmethod
    def concat(parts: list["PositionScores"]) -> "PositionScores":
        fields = ("kld", "same_top", "nll", "nll_base")
        return PositionScores(*(np.concatenate([getattr(p, f) for p in parts]) for f in fields))


def score_against_base(logits: torch.Tensor, rows: np.ndarray, targets: list[int] | np.ndarray,
                       block: int = 64) -> PositionScores:
    """Score rows of logits [n, vocab] against base-file rows [n, nv] (`targets`: the next token
    of each position), as llama.cpp's `--kl-divergence` does, `block` rows at a time."""
    n, vocab = logits.shape
    targets = torch.as_tensor(np.asarray(targets, dtype=np.int64))
    parts = []
    for start in range(0, n, block):
        end = min(start + block, n)
        log_q = torch.log_softmax(logits[start:end].float(), dim=-1)
        log_p = decompress_log_probs(rows[start:end], vocab)
        kept = log_p > -LOG_PROB_RANGE
        kld = torch.where(kept, log_p.exp() * (log_p - log_q), torch.zeros_like(log_p)).double().sum(dim=-1)
        index = targets[start:end, None]
        parts.append(PositionScores(
            kld=kld.numpy(),
            same_top=(log_q.argmax(dim=-1) == log_p.argmax(dim=-1)).numpy(),
            nll=-log_q.gather(1, index)[:, 0].double().numpy(),
            nll_base=-log_p.gather(1, index)[:, 0].double().numpy(),
        ))
    return PositionScores.concat(parts)


def summarize(scores: PositionScores) -> dict:
    """The figures llama.cpp prints for a run: mean KL divergence and its uncertainty (the
    standard error, sqrt(variance / (n - 1))), its 99th and 99.9th percentile (interpolated
    between ranks, as its `percentile`) and largest value; top-1 agreement in percent and its
    uncertainty; perplexity of the scored distribution and of the base; the positions."""
    kld, n = scores.kld, scores.kld.size
    top1 = float(scores.same_top.mean())
    return {
        "mean_kld": float(kld.mean()),
        "mean_kld_unc": float(np.sqrt(kld.var() / (n - 1))) if n > 1 else 0.0,
        "kld_p99": float(np.percentile(kld, 99.0)),
        "kld_p999": float(np.percentile(kld, 99.9)),
        "kld_max": float(kld.max()),
        "top1_pct": 100.0 * top1,
        "top1_pct_unc": 100.0 * float(np.sqrt(top1 * (1 - top1) / (n - 1))) if n > 1 else 0.0,
        "ppl": float(np.exp(scores.nll.mean())),
        "ppl_base": float(np.exp(scores.nll_base.mean())),
        "positions": int(kld.size),
    }
