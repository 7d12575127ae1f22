"""`HalfLinear`: an F16 or BF16 GGUF weight kept 16-bit in a float32 model; each product widens
the weight in slices of rows (exact: 16-bit values are float32 values)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.model.quant.base import LinearMethod

# Rows of a 16-bit weight widened to float32 at a time (a transient of ~4 MiB at 1024 columns).
_HALF_ROWS = 1024


@dataclass(eq=False)
class HalfLinear(LinearMethod):
    """An F16/BF16 GGUF weight kept 16-bit in a float32 model."""

    def apply(self, layer, x, bias=None):
        w = layer.weight
        parts = [F.linear(x, w[i : i + _HALF_ROWS].to(x.dtype)) for i in range(0, w.shape[0], _HALF_ROWS)]
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return y + bias if bias is not None else y

    def embed(self, layer, ids):
        return F.embedding(ids, layer.weight).float()

    def to_float(self, layer):
        return layer.weight.float()

    @property
    def cache_description(self) -> dict:
        return {"method": "half"}
