"""Rotary position embedding (RoPE) in the "rotate half" layout of Hugging Face Llama checkpoints,
with the `linear` and `llama3` frequency scalings."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.kernels import ops as fused_ops


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type != "llama3":
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
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


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # cos_sin: [max_position, head_dim], cos of each frequency twice then sin twice
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, qk: torch.Tensor) -> None:
        """Rotate, in place, the query and key heads at the front of each row of `qk`.

        positions: [num_tokens]; qk: [num_tokens, (num_heads + num_kv_heads) * head_dim], possibly
        a strided view into the fused q/k/v projection's output.
        """
        if fused_ops.applies_to_layer(qk) and self.cos.dtype == qk.dtype:
            fused_ops.rotary_(qk, positions, self.cos, self.sin, self.head_dim)
            return
        num_tokens = qk.shape[0]
        x = qk.view(num_tokens, -1, self.head_dim)  # [num_tokens, heads, head_dim]
        half = self.head_dim // 2
        cos = self.cos[positions, :half].unsqueeze(1)  # [num_tokens, 1, half]
        sin = self.sin[positions, :half].unsqueeze(1)
        x1, x2 = x[..., :half], x[..., half:]
        rotated_1 = x1 * cos - x2 * sin
        x2.mul_(cos).addcmul_(x1, sin)
        x1.copy_(rotated_1)
