"""The MLP activations, by transformers' ACT2FN names, computed as transformers computes them."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": _gelu_new,
    "relu": F.relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:  # arch.SUPPORTED_ACTIVATIONS refuses these when the config is read
        raise ValueError(f"Unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}.")
    return ACTIVATIONS[name]
