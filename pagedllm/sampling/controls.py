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
        row_ids, token_ids, values = [], [], []
        for r in biased:
            for token_id, bias in items[r].sampling_params.logit_bias.items():
                row_ids.append(r)
                token_ids.append(token_id)
                values.append(bias)
        index = (torch.tensor(row_ids, device=logits.device), torch.tensor(token_ids, device=logits.device))
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)
    return controls
