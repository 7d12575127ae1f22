"""The norms besides Llama's RMSNorm (`layers.RMSNorm`): Gemma's (1 + weight) RMSNorm and OPT's
LayerNorm, each computed in the order of rounding transformers uses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.layers import RMSNorm, _new_param, default_weight_loader


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), in float32, rounded to x's dtype once at the end (Llama rounds
    before the weight; Gemma after). The checkpoint's weight is stored as it is (near 0).

    Like Llama's, it takes the residual stream too (norm(residual + x), the sum written into
    `residual`); in float32 on a CPU both forms run the fused kernel with 1 + weight, as the
    C++ layer loop (`model.fused_layers`) does, bit for bit."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__(size, eps, dtype)
        self._shifted: tuple[tuple, torch.Tensor] | None = None

    def kernel_weight(self, dtype: torch.dtype) -> torch.Tensor | None:
        """1 + weight in float32 (computed once per value of the weight), for float32 rows."""
        if dtype != torch.float32:
            return None
        key = (self.weight.data_ptr(), self.weight._version)
        if self._shifted is None or self._shifted[0] != key:
            self._shifted = (key, (1.0 + self.weight.detach().float()).contiguous())
        return self._shifted[1]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
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
