"""The block engine of one worker: the key and value block pools of every layer on the device,
their mirror in CPU memory for swapping, and the block copies the scheduler asks for.

Pools are allocated once, at start-up, from a memory budget; one key pool and one value pool per
layer of a KV cache group (`kv_spec.kv_cache_groups`: all the layers, for a model whose layers
attend alike; a hybrid model's groups share the pools, the i-th layer of each using the i-th),
in the layout the attention backend chooses. A block id names the same slots in every pool, so
copies and swaps move a block in all of them.
"""

from __future__ import annotations

import logging

import torch

from pagedllm.attention import AttentionBackend
from pagedllm.worker.host_pool import HostKVPools

logger = logging.getLogger("pagedllm")


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across `num_layers` pools (the layers of a KV cache group), keys
    and values together."""
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def contiguous_runs(mapping: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first source, first destination, count) runs covering (source, destination) block pairs
    where both sides are consecutive, so each run is one copy."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in sorted(mapping):
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


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
        # On a GPU whose pools keep a block contiguous (blocks on dim 0), swaps are copies of runs
        # of blocks between the device and pinned memory on a stream of their own: the host never
        # waits for them (see `_swap`).
        self.swap_stream = torch.cuda.Stream(device) if device.type == "cuda" and self.block_dim == 0 else None

    def _copy_blocks(self, src_pools, dst_pools, mapping: list[tuple[int, int]]) -> None:
        if not mapping:
            return
        device = dst_pools[0].device
        src_ids = torch.tensor([s for s, _ in mapping], dtype=torch.long, device=src_pools[0].device)
        dst_ids = torch.tensor([d for _, d in mapping], dtype=torch.long, device=device)
        dim = self.block_dim
        for src, dst in zip(src_pools, dst_pools):
            # Gather first: a block may be a source and, elsewhere in the list, a destination.
            # A copy into host memory must be complete before the host scatters it: blocking.
            gathered = src.index_select(dim, src_ids).to(device, non_blocking=device.type != "cpu")
            dst.index_copy_(dim, dst_ids, gathered)

    def _swap(self, src_pools, dst_pools, mapping: list[tuple[int, int]]) -> None:
        """Copy blocks between the device and host pools. On a GPU the copies go on the swap
        stream, after the work already queued on the compute stream (the last step's KV writes),
        and the compute stream waits for them before the step's model runs: it may write into a
        block just swapped out, or read one just swapped in. The host does not wait."""
        if not mapping:
            return
        if self.swap_stream is None:
            self._copy_blocks(src_pools, dst_pools, mapping)
            return
        compute = torch.cuda.current_stream(self.swap_stream.device)
        self.swap_stream.wait_stream(compute)
        runs = contiguous_runs(mapping)
        with torch.cuda.stream(self.swap_stream):
            for src, dst in zip(src_pools, dst_pools):
                for first_src, first_dst, count in runs:
                    dst[first_dst : first_dst + count].copy_(src[first_src : first_src + count], non_blocking=True)
        compute.wait_stream(self.swap_stream)

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to CPU blocks: (device block, cpu block) pairs."""
        self._swap(self.key_caches, self.cpu_key_caches, mapping)
        self._swap(self.value_caches, self.cpu_value_caches, mapping)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy CPU blocks back to device blocks: (cpu block, device block) pairs."""
        self._swap(self.cpu_key_caches, self.key_caches, mapping)
        self._swap(self.cpu_value_caches, self.value_caches, mapping)

    def copy(self, mapping: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate device blocks, (source, destination) pairs."""
        self._copy_blocks(self.key_caches, self.key_caches, mapping)
        self._copy_blocks(self.value_caches, self.value_caches, mapping)
