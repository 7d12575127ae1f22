"""Choosing a layer's method when its weight arrives from the checkpoint (`load_part`), or from
the weight cache's description (`from_cache`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagedllm.model.quant.base import LinearMethod, install
from pagedllm.model.quant.float import FloatLinear
from pagedllm.model.quant.gguf import GGUFLinear, flat_parameter, gguf_from_cache, packed
from pagedllm.model.quant.half import HalfLinear
from pagedllm.model.weights import GGUFBlocks


@dataclass
class _Pending:
    """The parts of a fused weight that have arrived (part index -> lazy weight, row offset)."""

    parts: dict[int, tuple[Any, int]] = field(default_factory=dict)


def load_part(layer: nn.Module, weight, row_offset: int, part: int = 0, num_parts: int = 1) -> None:
    """Receive part `part` of `layer`'s weight (a lazy weight: its rows go at `row_offset`); once
    all `num_parts` have arrived, choose the layer's method and fill it (`assemble`)."""
    if num_parts == 1:
        _assemble(layer, [(weight, row_offset)])
        return
    pending = layer.__dict__.setdefault("_pending_parts", _Pending())
    pending.parts[part] = (weight, row_offset)
    if len(pending.parts) == num_parts:
        del layer.__dict__["_pending_parts"]
        _assemble(layer, [pending.parts[i] for i in range(num_parts)])


def _native(weight):
    return weight.load_native() if hasattr(weight, "load_native") else None


def _assemble(layer: nn.Module, parts: list[tuple[Any, int]]) -> None:
    """GGUF blocks when every part has them, one 16-bit tensor when every part is 16-bit of one
    dtype, else float in the model's dtype (parts dequantized)."""
    natives = [_native(w) for w, _ in parts]
    if all(isinstance(n, GGUFBlocks) for n in natives):
        weights = packed(natives)
        del natives
        install(layer, GGUFLinear(weights), flat_parameter(weights).data)
        return
    if all(isinstance(n, torch.Tensor) for n in natives) and len({n.dtype for n in natives}) == 1:
        install(layer, HalfLinear(), natives[0] if len(natives) == 1 else torch.cat(natives))
        return
    param = layer.weight
    if param.dtype == torch.uint8 or param.dim() != 2:
        raise RuntimeError("a layer's weight was loaded twice in different forms")
    for (weight, offset), native in zip(parts, natives):
        if isinstance(native, GGUFBlocks):
            value = weight.load()  # dequantized (another part has no kernel)
        elif native is not None:
            value = native
        else:
            value = weight.load()
        target = param.data.narrow(0, offset, value.shape[0])
        if tuple(target.shape) != tuple(value.shape):
            raise ValueError(f"checkpoint tensor of shape {tuple(value.shape)} does not fit parameter {tuple(target.shape)}")
        target.copy_(value)
    layer.quant_method = FloatLinear()


def from_cache(description: dict | None) -> LinearMethod:
    """The method the weight cache described (`cache_description`), before `install`."""
    if description is None:
        return FloatLinear()
    if description["method"] == "half":
        return HalfLinear()
    if description["method"] == "gguf":
        return gguf_from_cache(description)
    raise ValueError(f"unknown weight method {description['method']!r} in the weight cache")
