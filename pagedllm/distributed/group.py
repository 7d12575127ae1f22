"""The one object a tensor-parallel layer needs: its rank, the group size and the collectives.

With `size == 1` every collective is the identity, so the same layers run on one worker
without torch.distributed being initialised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # ProcessGroup for tensors (gloo on CPU, nccl on GPU)
    control_group: Any = None  # gloo ProcessGroup for the driver's control messages (workers wait on it unbounded)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's `x` along `dim` on rank 0; other ranks get None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast_object(self, obj: Any = None) -> Any:
        """Send a picklable object from rank 0 to every rank; returns it everywhere."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank 0; None elsewhere."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control_group)
        return out

    def close(self) -> None:
        """End torch.distributed's groups (the default one with ours) and let go of ours: with no
        reference left, each group's C++ object and its gloo threads end here, while the
        interpreter runs. (Held by this frozen object, they lived on to the interpreter's teardown,
        and a rank 0 launched by torchrun once in a while aborted there after its output: "terminate
        called without an active exception".) No collective works after."""
        if dist.is_initialized():
            dist.destroy_process_group()
        object.__setattr__(self, "group", None)
        object.__setattr__(self, "control_group", None)

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` items that must divide evenly (e.g. attention heads)."""
        if total % self.size:
            valid = [d for d in range(1, total + 1) if total % d == 0]
            raise ValueError(
                f"{what} ({total}) cannot be split across tensor_parallel_size={self.size}; "
                f"valid sizes: {valid}."
            )
        return total // self.size
