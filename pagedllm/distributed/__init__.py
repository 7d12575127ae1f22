"""Tensor-parallel process groups (torch.distributed: gloo on CPU, nccl on GPU)."""

from pagedllm.distributed.group import TensorParallelGroup

__all__ = ["TensorParallelGroup"]
