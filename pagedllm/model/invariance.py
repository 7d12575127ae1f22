"""Batch-invariant projections: a row's product computed the same way whatever rows share it.

A matrix product's reduction order is the kernel's choice, and most kernels choose by the number
of rows (MKL's sgemm does: a row's result changes with the batch). oneDNN's packed products on
the machines measured keep one order along the reduced dimension for every row count, so they
are invariant as they are; since that is a property of the kernel oneDNN picks for this CPU, it is
checked at start-up on every weight shape of the model, at every row count a product runs at
(`onednn.row_bucket`) and at every position in the batch. Where it fails, products run in tiles
of a fixed row count instead (one kernel for all), which is invariant by construction.

The quantized kernel is dropped: it serves only small row counts, so a decode step would
otherwise change kernels with the batch size.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm.kernels import onednn

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
    if any(p.dim() == 3 for p in model.parameters()):
        raise ValueError(
            "batch_invariant=True is not supported for mixture-of-experts models: their expert products run on "
            "each expert's tokens, so a row's reduction order follows the batch. Drop batch_invariant."
        )
    params = {id(p): p for name, p in model.named_parameters() if name.endswith("weight") and p.dim() == 2}
    projections = [p for p in params.values() if hasattr(p, "packed")]
    missing = [p for p in projections if p.packed is None]
    if not projections or missing:
        raise ValueError(
            "batch_invariant=True needs every projection in oneDNN's packed float32 form (dtype float32 on a CPU "
            "whose torch has oneDNN); this model's are not. Use dtype='float32' or drop batch_invariant."
        )
    shapes: dict[tuple[int, int], bool] = {}
    for param in projections:
        param.quantized = None
        shape = tuple(param.shape)
        if shape not in shapes:
            shapes[shape] = _row_invariant(param.packed, shape[1])
        param.row_tile = None if shapes[shape] else FIXED_ROW_TILE
    tiled = sorted(shape for shape, ok in shapes.items() if not ok)
    if tiled:
        logger.info("Batch-invariant: oneDNN's products vary with the row count for shapes %s here; those run in "
                    "tiles of %d rows", tiled, FIXED_ROW_TILE)
