"""Rotary position embedding (RoPE) in the "rotate half" layout of Hugging Face checkpoints, with
transformers' frequency scalings: `linear`, `llama3`, `yarn` and `longrope` (Phi-3), the
attention factor the last two fold into cos and sin, and a partial rotary (the first
`partial_rotary_factor` of each head turns, the rest passes through: Phi-4-mini).

LongRoPE has two sets of frequencies: the short one while a sequence is within the pretraining
length, the long one past it. transformers picks the set by the length of the sequence at each
forward pass; so does this module, per sequence and per step (`table_positions`). Keys already
cached stay as they were rotated (transformers' Phi-3 re-encodes its whole cache once, the first
time a sequence crosses the length; a paged cache of rotated keys does not).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.kernels import ops as fused_ops


def _default_inverse_frequencies(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between, and
    an attention factor (transformers' `_compute_yarn_parameters`)."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of each frequency extrapolated
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _longrope(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """LongRoPE (Phi-3): (short, long) inverse frequencies and the attention factor."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short, long = (1.0 / (torch.tensor(scaling[key], dtype=torch.float32) * theta**shape)
                   for key in ("short_factor", "long_factor"))
    return short, long, float(attention_factor)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """The inverse frequencies of a plain, linear or llama3 rotary over `head_dim` dimensions."""
    inv_freq = _default_inverse_frequencies(head_dim, theta)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None, dtype: torch.dtype,
        partial_rotary_factor: float = 1.0,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        self.max_position = max_position
        rope_type = (scaling or {}).get("rope_type", "default")
        attention_factor = 1.0
        # LongRoPE: the long set's table follows the short one's; `table_positions` picks.
        self.longrope_threshold: int | None = None
        if rope_type == "yarn":
            sets, attention_factor = _yarn(self.rotary_dim, theta, scaling)
            sets = [sets]
        elif rope_type == "longrope":
            short, long, attention_factor = _longrope(self.rotary_dim, theta, scaling)
            sets = [short, long]
            self.longrope_threshold = scaling["original_max_position_embeddings"]
        else:
            sets = [rope_inverse_frequencies(self.rotary_dim, theta, scaling)]
        positions = torch.arange(max_position, dtype=torch.float32)
        # cos, sin: [max_position * len(sets), rotary_dim], each frequency twice
        emb = torch.cat([torch.cat([f, f], dim=-1) for f in (torch.outer(positions, s) for s in sets)])
        self.register_buffer("cos", (emb.cos() * attention_factor).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * attention_factor).to(dtype), persistent=False)

    def table_positions(self, positions: torch.Tensor, metadata) -> torch.Tensor:
        """The row of the cos/sin table for each token: its position, or for LongRoPE, its
        position in the long set's rows when its sequence is longer than the pretraining length
        at this step. positions: [num_tokens]. While no sequence is longer than that (checked on
        the host), the rows are the positions themselves: the same tensor, so that the fused step
        keeps them (`FusedDecoderLayers.rows_limit`)."""
        if self.longrope_threshold is None or metadata.max_seq_len <= self.longrope_threshold:
            return positions
        if metadata.num_decodes == len(metadata.query_lens):  # one token per sequence (CUDA graphs too)
            lengths = metadata.seq_lens
        elif len(set(metadata.query_lens)) == 1:  # as many each (a CUDA graph's verify step): no host sync
            lengths = metadata.seq_lens[:, None].expand(-1, metadata.query_lens[0]).reshape(-1)
        else:
            repeats = torch.tensor(metadata.query_lens, device=positions.device)
            lengths = torch.repeat_interleave(metadata.seq_lens, repeats)
        return positions + (lengths > self.longrope_threshold).to(positions.dtype) * self.max_position

    def forward(self, positions: torch.Tensor, qk: torch.Tensor) -> None:
        """Rotate, in place, the query and key heads at the front of each row of `qk`.

        positions: [num_tokens] rows of the table (`table_positions`); qk: [num_tokens,
        (num_heads + num_kv_heads) * head_dim], possibly a strided view into the fused q/k/v
        projection's output.
        """
        if fused_ops.applies_to_layer(qk) and self.cos.dtype == qk.dtype:
            fused_ops.rotary_(qk, positions, self.cos, self.sin, self.head_dim)
            return
        num_tokens = qk.shape[0]
        x = qk.view(num_tokens, -1, self.head_dim)  # [num_tokens, heads, head_dim]
        half = self.rotary_dim // 2
        cos = self.cos[positions, :half].unsqueeze(1)  # [num_tokens, 1, half]
        sin = self.sin[positions, :half].unsqueeze(1)
        x1, x2 = x[..., :half], x[..., half : self.rotary_dim]
        rotated_1 = x1 * cos - x2 * sin
        x2.mul_(cos).addcmul_(x1, sin)
        x1.copy_(rotated_1)
