"""Where a worker's memory goes: the weights, the KV cache, the swap pool, and the rest of the
process (interpreter, libraries, tokenizer), measured rather than estimated, so the parts add up
to the resident set size the OS reports.

Anonymous memory is counted page by page with `mincore` (a pool allocated but never written
takes no memory); the weight cache's file mappings by their resident size in
`/proc/self/smaps`; oneDNN's packed weights, opaque to both, by their size. Linux only; elsewhere
every figure is the nominal size and the rest is not known.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedllm.model.quant import method_layers
from pagedllm.model.weight_cache import cache_file_mappings

GiB = 1 << 30
_LINUX = sys.platform.startswith("linux")


def process_rss() -> int | None:
    """This process's resident set size in bytes (None where unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE
    except (OSError, IndexError, ValueError):
        return None


def _resident_pages(first: int, last: int) -> int:
    """How many of the pages [first, last) (page numbers) are resident."""
    page = mmap.PAGESIZE
    vec = (ctypes.c_ubyte * (last - first))()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(first * page), ctypes.c_size_t((last - first) * page), vec) != 0:
        return last - first
    return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())


class PageCounter:
    """Counts the resident pages under tensors, each page once across every call: small
    tensors share pages with their neighbours, and a page goes to whichever part claims it
    first. Anonymous memory only (for a file mapping, mincore reports the page cache)."""

    def __init__(self, skip: list[tuple[int, int]] = ()) -> None:
        page = mmap.PAGESIZE
        self.claimed = [(lo // page, -(-hi // page)) for lo, hi in skip]  # page intervals

    def resident_bytes(self, tensors: Iterable[torch.Tensor | None]) -> int:
        page = mmap.PAGESIZE
        wanted = set()
        for t in tensors:
            if t is None or t.device.type != "cpu" or t.layout != torch.strided or t.numel() == 0:
                continue
            storage = t.untyped_storage()
            wanted.add((storage.data_ptr() // page, -(-(storage.data_ptr() + storage.nbytes()) // page)))
        total = 0
        for first, last in sorted(wanted):
            for lo, hi in self._unclaimed(first, last):
                total += _resident_pages(lo, hi) if _LINUX else hi - lo
                self.claimed.append((lo, hi))
        return total * page

    def _unclaimed(self, first: int, last: int) -> list[tuple[int, int]]:
        parts = [(first, last)]
        for lo, hi in self.claimed:
            parts = [piece for a, b in parts for piece in ((a, min(b, lo)), (max(a, hi), b)) if piece[0] < piece[1]]
        return parts


def _weight_tensors(model: nn.Module) -> tuple[list[torch.Tensor], int]:
    """Every weight form's tensor, and the bytes of the opaque (oneDNN-packed) ones."""
    tensors = [param.data for param in {id(p): p for p in model.parameters()}.values()]
    methods = {id(m.quant_method): m.quant_method for m in method_layers(model).values()}
    opaque = 0
    for method in methods.values():
        tensors += method.extra_tensors()
        opaque += method.extra_bytes()
    return tensors, opaque


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes, resident on the host unless `device` says the weights and KV cache live there."""

    weights: int
    kv_cache: int
    kv_cache_reserved: int
    swap_pool: int
    swap_pool_reserved: int
    rss: int | None
    device: str = "cpu"

    @property
    def rest(self) -> int | None:
        """The process's other memory: interpreter, libraries, tokenizer, activations."""
        if self.rss is None:
            return None
        on_host = self.weights + self.kv_cache if self.device == "cpu" else 0
        return self.rss - on_host - self.swap_pool

    def __str__(self) -> str:
        def gib(n: int | None) -> str:
            return "?" if n is None else f"{n / GiB:.2f} GiB"

        where = "" if self.device == "cpu" else f" on {self.device}"
        return (
            f"Memory: weights {gib(self.weights)}, KV cache {gib(self.kv_cache)}{where} (of {gib(self.kv_cache_reserved)} reserved), "
            f"swap pool {gib(self.swap_pool)} (of {gib(self.swap_pool_reserved)} reserved), "
            f"rest {gib(self.rest)} (RSS {gib(self.rss)})"
        )


def memory_budget(model: nn.Module, kv_pools: list[torch.Tensor], swap_pools: list[torch.Tensor]) -> MemoryBudget:
    """Measure what the weights, the KV pools and the swap pools hold now."""
    device = next(model.parameters()).device
    tensors, opaque = _weight_tensors(model)
    mappings = cache_file_mappings() if _LINUX else []
    mapped = sum(rss for _, _, rss in mappings)
    pages = PageCounter(skip=[(lo, hi) for lo, hi, _ in mappings])  # those pages are counted from smaps
    if device.type == "cpu":
        weights = mapped + pages.resident_bytes(tensors) + opaque
        kv_cache = pages.resident_bytes(kv_pools)
    else:  # on the device every byte allocated is taken
        weights = sum(t.numel() * t.element_size() for t in tensors if t is not None and t.device == device)
        kv_cache = sum(t.numel() * t.element_size() for t in kv_pools)
    return MemoryBudget(
        weights=weights,
        kv_cache=kv_cache,
        kv_cache_reserved=sum(t.numel() * t.element_size() for t in kv_pools),
        swap_pool=pages.resident_bytes(swap_pools),
        swap_pool_reserved=sum(t.numel() * t.element_size() for t in swap_pools),
        rss=process_rss(),
        device=str(device),
    )
