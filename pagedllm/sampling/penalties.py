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
    and presence penalties (over output tokens, as in the OpenAI API).

    Only the tokens a sequence has seen change, so only they are touched: a row of 262,144
    logits is not walked per penalty (five passes over it cost a millisecond a token on a 2-core
    CPU). Each value changed is computed as the whole-row formulas compute it."""
    rows = [r for r, item in enumerate(items) if item.sampling_params.needs_penalties]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for r in rows:
        params = items[r].sampling_params
        row = logits[r]
        output_ids = torch.tensor(items[r].output_token_ids or [], dtype=torch.long, device=logits.device)
        output_ids, counts = torch.unique(output_ids[output_ids < vocab], return_counts=True)
        if params.repetition_penalty != 1.0:
            prompt_ids = torch.tensor(items[r].prompt_token_ids or [], dtype=torch.long, device=logits.device)
            seen = torch.unique(torch.cat([output_ids, prompt_ids[prompt_ids < vocab]]))
            values = row[seen]
            row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
        if params.frequency_penalty or params.presence_penalty:
            counts = counts.to(logits.dtype)
            row[output_ids] = row[output_ids] - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits
