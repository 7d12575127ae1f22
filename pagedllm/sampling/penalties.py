"""Logits processors that depend on a sequence's history: min_tokens and the penalties."""

from __future__ import annotations

import torch

from pagedllm.core.scheduler_output import ScheduledSequence


def apply_min_tokens(logits: torch.Tensor, items: list[ScheduledSequence]) -> torch.Tensor:
    """Forbid the stop tokens (EOS unless ignored, stop_token_ids) until min_tokens are out."""
    rows, cols = [], []
    for r, item in enumerate(items):
        params = item.sampling_params
        if item.num_output_tokens < params.min_tokens and params.all_stop_token_ids:
            for token_id in params.all_stop_token_ids:
                rows.append(r)
                cols.append(token_id)
    if not rows:
        return logits
    logits = logits.clone()
    logits[rows, cols] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, items: list[ScheduledSequence]) -> torch.Tensor:
    """Repetition penalty (over prompt and output tokens, as in vLLM and CTRL), then frequency
    and presence penalties (over output tokens, as in the OpenAI API)."""
    rows = [r for r, item in enumerate(items) if item.sampling_params.needs_penalties]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for r in rows:
        params = items[r].sampling_params
        output_ids = torch.tensor(items[r].output_token_ids or [], dtype=torch.long, device=logits.device)
        counts = torch.bincount(output_ids, minlength=vocab)[:vocab].to(logits.dtype)
        row = logits[r]
        if params.repetition_penalty != 1.0:
            seen = counts > 0
            prompt_ids = torch.tensor(items[r].prompt_token_ids or [], dtype=torch.long, device=logits.device)
            seen[prompt_ids[prompt_ids < vocab]] = True
            penalised = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
            row = torch.where(seen, penalised, row)
        row = row - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)
        logits[r] = row
    return logits
