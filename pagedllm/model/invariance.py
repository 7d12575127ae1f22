"""Batch-invariant projections: a row's product computed the same way whatever rows share it.

A matrix product's reduction order is the kernel's choice, and most kernels choose by the number
of rows (MKL's sgemm does: a row's result changes with the batch). oneDNN's packed products on
the machines measured keep one order along the reduced dimension for every row count, so they
are invariant as they are; since that is a property of the kernel oneDNN picks for this CPU, it is
checked at start-up on every weight shape of the model, at every row count a product runs at
(`onednn.row_bucket`) and at every position in the batch. Where it fails, products run in tiles
of a fixed row count instead (one kernel for all), which is invariant by construction.

Whether a layer's products are invariant is its method's property (`LinearMethod.batch_invariant`):
a GGUF-packed weight is dequantized to float32 here (`quant.use_float`: the quantized
kernels pick their way by row count), so this mode holds float copies of a GGUF model.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm.kernels import onednn
from pagedllm.model import quant
from pagedllm.model.quant import experts as quant_experts
from pagedllm.model.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, prepare_linear_weights

logger = logging.getLogger("pagedllm")

# Rows per product where oneDNN's own choice is not invariant (one primitive for every product).
FIXED_ROW_TILE = 16
_CHECK_ROWS = 2 * onednn.CHUNK_ROWS + 1


def _row_invariant(packed: torch.Tensor, in_features: int) -> bool:
    """Each row's result is bitwise the same at every row count and position it may run at."""
    x = torch.randn(_CHECK_ROWS, in_features, generator=torch.Generator().manual_seed(in_features))
    full = onednn.packed_linear(x, packed)
    counts = sorted({onednn.row_bucket(rows) for rows in range(1, onednn.CHUNK_ROWS + 1)})
    for rows in counts:
        for start in (0, 1):  # the same rows, at another position
            part = x[start : start + rows]
            if not torch.equal(onednn.packed_linear(part, packed), full[start : start + rows]):
                return False
    return True


def make_batch_invariant(model: nn.Module) -> None:
    """Prepare a loaded model's projections for batch-invariant inference (float32, CPU)."""
    if any(isinstance(getattr(m, "experts_method", None), quant_experts.ExpertsMethod) for m in model.modules()):
        raise ValueError(
            "batch_invariant=True is not supported for mixture-of-experts models: their expert products run on "
            "each expert's tokens, so a row's reduction order follows the batch. Drop batch_invariant."
        )
    layers = list(quant.method_layers(model).values())
    for layer in layers:
        if not layer.quant_method.dense and "tied_embedding" not in layer.__dict__:
            quant.use_float(layer)  # (a tied head follows its table: tie_weights)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    prepare_linear_weights(model)
    projections = {id(m.quant_method): m for m in layers if _is_projection(m)}
    if not projections or not all(m.quant_method.batch_invariant for m in projections.values()):
        raise ValueError(
            "batch_invariant=True needs every projection in oneDNN's packed float32 form (dtype float32 on a CPU "
            "whose torch has oneDNN); this model's are not. Use dtype='float32' or drop batch_invariant."
        )
    shapes: dict[tuple[int, int], bool] = {}
    for layer in projections.values():
        method = layer.quant_method
        shape = tuple(layer.weight.shape)
        if shape not in shapes:
            shapes[shape] = _row_invariant(method.packed, shape[1])
        method.row_tile = None if shapes[shape] else FIXED_ROW_TILE
    tiled = sorted(shape for shape, ok in shapes.items() if not ok)
    if tiled:
        logger.info("Batch-invariant: oneDNN's products vary with the row count for shapes %s here; those run in "
                    "tiles of %d rows", tiled, FIXED_ROW_TILE)


def _is_projection(layer: nn.Module) -> bool:
    return isinstance(layer, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead))
