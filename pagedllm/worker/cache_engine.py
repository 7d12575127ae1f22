"""The block engine of one worker: the key and value block pools of every layer on the device,
their mirror in CPU memory for swapping, and the block copies the scheduler asks for.

Pools are allocated once, at start-up, from a memory budget; one key pool and one value pool per
layer, in the layout the attention backend chooses.
"""

from __future__ import annotations

import logging

import torch

from pagedllm.attention import AttentionBackend
from pagedllm.worker.host_pool import HostKVPools

logger = logging.getLogger("pagedllm")


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values together."""
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


class CacheEngine:
    def __init__(
        self,
        backend: AttentionBackend,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_device_blocks: int,
        num_cpu_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.block_dim = backend.block_dim
        self.num_device_blocks = num_device_blocks
        self.num_cpu_blocks = num_cpu_blocks
        shape = backend.kv_cache_shape(num_device_blocks, block_size, num_kv_heads, head_dim)
        # The whole budget is taken at start-up, not on first use: zeroed on a GPU; on a CPU,
        # zero pages mapped by a background thread while the server starts (see host_pool).
        self.host_pools: HostKVPools | None = None
        if device.type == "cpu":
            self.host_pools = HostKVPools(2 * num_layers, shape, dtype)
            self.key_caches = self.host_pools.tensors[:num_layers]
            self.value_caches = self.host_pools.tensors[num_layers:]
        else:
            self.key_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.value_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        cpu_shape = backend.kv_cache_shape(num_cpu_blocks, block_size, num_kv_heads, head_dim)
        pin = device.type == "cuda"
        # The swap space is touched only when something is swapped out.
        self.cpu_key_caches = [torch.empty(cpu_shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]
        self.cpu_value_caches = [torch.empty(cpu_shape, dtype=dtype, pin_memory=pin) for _ in range(num_layers)]

    def _copy_blocks(self, src_pools, dst_pools, mapping: list[tuple[int, int]]) -> None:
        if not mapping:
            return
        device = dst_pools[0].device
        src_ids = torch.tensor([s for s, _ in mapping], dtype=torch.long, device=src_pools[0].device)
        dst_ids = torch.tensor([d for _, d in mapping], dtype=torch.long, device=device)
        dim = self.block_dim
        for src, dst in zip(src_pools, dst_pools):
            # Gather first: a block may be a source and, elsewhere in the list, a destination.
            dst.index_copy_(dim, dst_ids, src.index_select(dim, src_ids).to(device, non_blocking=True))

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to CPU blocks: (device block, cpu block) pairs."""
        self._copy_blocks(self.key_caches, self.cpu_key_caches, mapping)
        self._copy_blocks(self.value_caches, self.cpu_value_caches, mapping)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy CPU blocks back to device blocks: (cpu block, device block) pairs."""
        self._copy_blocks(self.cpu_key_caches, self.key_caches, mapping)
        self._copy_blocks(self.cpu_value_caches, self.value_caches, mapping)

    def copy(self, mapping: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate device blocks, (source, destination) pairs."""
        self._copy_blocks(self.key_caches, self.key_caches, mapping)
        self._copy_blocks(self.value_caches, self.value_caches, mapping)
