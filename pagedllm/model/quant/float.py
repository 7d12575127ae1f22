"""`FloatLinear`: a float weight in the model's dtype; on a CPU, oneDNN's reordered copy serves
the products (`process_weights_after_loading` through `layers.prepare_linear_weights`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import onednn
from pagedllm.model.quant.base import LinearMethod, install


@dataclass(eq=False)
class FloatLinear(LinearMethod):
    """A float weight; on a CPU, oneDNN's reordered copy serves the products of the weight's own
    dtype (`row_tile`: run every product at that many rows, for batch invariance)."""

    packed: torch.Tensor | None = field(default=None, repr=False)
    row_tile: int | None = None
    dense = True

    @property
    def batch_invariant(self) -> bool:  # checked per shape by invariance.py, which sets row_tile
        return self.packed is not None

    def apply(self, layer, x, bias=None):
        if self.packed is not None and x.dtype == layer.weight.dtype:
            return onednn.packed_linear(x, self.packed, bias, self.row_tile)
        return F.linear(x, layer.weight, bias)

    def embed(self, layer, ids):
        return F.embedding(ids, layer.weight)

    def to_float(self, layer):
        return layer.weight.float()

    def extra_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() if self.packed is not None else 0


def use_float(layer: nn.Module) -> None:
    """Replace the layer's method by `FloatLinear` over its dequantized weight (batch-invariant mode)."""
    if layer.quant_method.dense:
        return
    install(layer, FloatLinear(), layer.quant_method.to_float(layer).contiguous())
