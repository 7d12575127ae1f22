"""The norms besides Llama's RMSNorm (`layers.RMSNorm`): Gemma's (1 + weight) RMSNorm and OPT's
LayerNorm, each computed in the order of rounding transformers uses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.layers import _new_param, default_weight_loader


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, rounded to x's dtype once at the end (Llama rounds
    before the weight; Gemma after). The checkpoint's weight is stored as it is (near 0)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _new_param(size, dtype=dtype, loader=default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class LayerNorm(nn.Module):
    """torch's LayerNorm over the last dimension, with or without weight and bias."""

    def __init__(self, size: int, eps: float, elementwise_affine: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.size, self.eps = size, eps
        self.weight = _new_param(size, dtype=dtype, loader=default_weight_loader) if elementwise_affine else None
        self.bias = _new_param(size, dtype=dtype, loader=default_weight_loader) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.size,), self.weight, self.bias, self.eps)
