"""Token-level controls on the logits, before penalties and sampling: each constrained row's
bitmask of allowed tokens (structured outputs, allowed_token_ids, bad_words; computed by the
engine) and each request's logit_bias. Rows without either are not touched."""

from __future__ import annotations

import sys

import torch

from pagedllm.core.scheduler_output import ScheduledSequence


def unpack_bitmask(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab]: token t allowed when bit t % 32 of word t // 32 is set.
    packed: int32 [rows, ceil(vocab / 32)]. (For tests and debugging; the sampler applies masks
    with xgrammar's kernel.)"""
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    return bits.flatten(1)[:, :vocab_size].bool()


class AppliedControls:
    """What `apply_token_controls` changed: the rows whose raw values are still needed (logit
    biases, or log-probabilities asked for) were saved, to be put back once tokens are chosen."""

    def __init__(self, rows: torch.Tensor | None, saved: torch.Tensor | None) -> None:
        self.rows, self.saved = rows, saved

    def restore(self, logits: torch.Tensor) -> None:
        if self.rows is not None:
            logits[self.rows] = self.saved


def apply_token_controls(logits: torch.Tensor, items: list[ScheduledSequence]) -> AppliedControls | None:
    """Set forbidden tokens to -inf and add the logit biases, in place, on the rows that have
    either; None when no row has. logits: [len(items), vocab].

    Masking changes no allowed token's value, so the raw log-probability of a chosen token
    needs nothing back; only rows with a bias, or whose top log-probabilities are reported,
    are saved first (not the whole batch)."""
    masked = [r for r, item in enumerate(items) if item.token_bitmask is not None]
    biased = [r for r, item in enumerate(items) if item.sampling_params.logit_bias]
    if not masked and not biased:
        return None
    vocab = logits.shape[1]
    keep = sorted(set(biased) | {r for r in masked if items[r].sampling_params.logprobs is not None})
    rows = torch.tensor(keep, device=logits.device) if keep else None
    controls = AppliedControls(rows, logits[rows] if keep else None)
    if masked:
        bitmask = torch.full((len(items), items[masked[0]].token_bitmask.shape[0]), -1, dtype=torch.int32)
        for r in masked:  # row copies: small enough to stay on this thread (an indexed put does not)
            bitmask[r] = items[r].token_bitmask
        xgrammar = sys.modules.get("xgrammar")
        if xgrammar is not None:
            # One batched application for every constrained row of the step: xgrammar's kernel
            # (C++ on a CPU, CUDA or Triton on a GPU) touches only the listed rows.
            xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab, indices=masked)
        else:
            # No grammar was ever compiled (allowed_token_ids, bad_words): the same masking in
            # torch, rather than importing xgrammar (seconds) on the engine's thread.
            index = torch.tensor(masked, device=logits.device)
            allowed = unpack_bitmask(bitmask[masked].to(logits.device), vocab)
            if allowed.shape[1] < vocab:  # tokens past the bitmask are not allowed (as xgrammar)
                allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
            logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    if biased:
        tables = [logit_bias_tensors(items[r].sampling_params) for r in biased]
        row_ids = torch.cat([torch.full_like(ids, r) for r, (ids, _) in zip(biased, tables)])
        token_ids = torch.cat([ids for ids, _ in tables])
        values = torch.cat([values for _, values in tables])
        index = (row_ids.to(logits.device), token_ids.to(logits.device))
        logits.index_put_(index, values.to(device=logits.device, dtype=logits.dtype), accumulate=True)
    return controls


def logit_bias_tensors(params) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's logit_bias as (token ids, biases) tensors, built once per request (kept on its
    `SamplingParams`) rather than walked in Python at every step."""
    cached = params.__dict__.get("_logit_bias_tensors")
    if cached is None:
        bias = params.logit_bias
        cached = (torch.tensor(list(bias.keys()), dtype=torch.int64), torch.tensor(list(bias.values()), dtype=torch.float32))
        params.__dict__["_logit_bias_tensors"] = cached
    return cached
