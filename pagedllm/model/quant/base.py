"""The interface of a linear layer's weight method, and what every method shares: installing one
over its storage, finding the layers that own one, and reading a weight whatever its form."""

from __future__ import annotations

import torch
from torch import nn


class LinearMethod:
    """How a layer's weight is stored and multiplied (the package's docstring lists the forms)."""

    batch_invariant = False
    int8_rows = 0
    # The weight is a float [out, in] tensor in `layer.weight` (oneDNN can pack it; padding rows
    # can be zeroed; batch-invariant mode keeps it as it is).
    dense = False

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] -> x W^T + b [rows, out] (`layer.weight` holds the weight's storage)."""
        raise NotImplementedError

    def samples_in_product(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether `sample` serves an LM head `layer` (a `ParallelLMHead` on one rank) at `x`."""
        return False

    def sample(self, layer: nn.Module, x: torch.Tensor, draws) -> tuple[list[int], list[float]]:
        """Where `samples_in_product`: each row of x W^T's token (greedy, or the top-k draw
        `draws` asks for: `kernels.gguf.Draws`, None where every row is greedy) and its
        log-probability, computed with the product: no logits read back."""
        raise NotImplementedError

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight (an embedding lookup) in the model's dtype."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Lay the weight out for its kernel once it is loaded and placed."""

    def bind(self, storage: torch.Tensor) -> None:
        """Point the method at its weight's storage (the layer's parameter data), once installed:
        a method that keeps views of it (packed blocks) takes them here."""

    def logical_shape(self, layer: nn.Module) -> tuple[int, int]:
        """(out_features, in_features) of the weight, whatever its storage."""
        return tuple(layer.weight.shape)

    def to_float(self, layer: nn.Module) -> torch.Tensor:
        """The weight dequantized: a float32 [out, in] tensor."""
        raise NotImplementedError

    @property
    def supports_int8(self) -> bool:
        return False

    @property
    def fused_parts(self) -> list | None:
        """The packed parts the C++ decoder loop multiplies by (`gguf_matmul`), or None where it cannot."""
        return None

    @property
    def cache_description(self) -> dict | None:
        """What the weight cache stores to rebuild this method over the saved weight (None: a float weight)."""
        return None

    def extra_tensors(self) -> list[torch.Tensor]:
        """Tensors the method holds besides `layer.weight` (for the memory report)."""
        return []

    def extra_bytes(self) -> int:
        """Bytes of opaque forms (oneDNN's packed copy) that the memory report cannot see as pages."""
        return 0


def install(layer: nn.Module, method: LinearMethod, weight: torch.Tensor) -> None:
    """Make `method` the layer's, over `weight` (its storage: float, 16-bit, or packed bytes),
    keeping the parameter's weight loader."""
    old = layer.weight
    param = nn.Parameter(weight, requires_grad=False)
    if hasattr(old, "weight_loader"):
        param.weight_loader = old.weight_loader
    layer.weight = param
    method.bind(param.data)
    layer.quant_method = method


def method_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every module that owns a weight through a method, by name (a tied head not again)."""
    return {name: m for name, m in model.named_modules() if "quant_method" in m.__dict__}


def layer_of(model: nn.Module, weight: torch.Tensor) -> nn.Module:
    """The layer whose method owns `weight` (a parameter `layer_projections` names)."""
    return next(m for m in method_layers(model).values() if m.weight is weight)


def dense_weight(model: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """`weight` as a float32 [out, in] matrix, whatever its form (dequantized for a packed one)."""
    layer = layer_of(model, weight)
    return layer.quant_method.to_float(layer)


def logical_shape(layer: nn.Module) -> tuple[int, int]:
    """(out_features, in_features) of the layer's weight, whatever its storage."""
    return layer.quant_method.logical_shape(layer)
