"""Where a worker's memory goes: the weights, the KV cache, the swap pool, and the rest of the
process (interpreter, libraries, tokenizer), measured rather than estimated, so the parts add up
to the resident set size the OS reports.

Anonymous memory is counted page by page with `mincore` (a pool allocated but never written
takes no memory); the weight cache's file mappings by their resident size in
`/proc/self/smaps`; oneDNN's packed weights, opaque to both, by their size. Linux only; elsewhere
every figure is the nominal size and the rest is not known.

The weights have two figures: what they take once read (`weight_bytes`: every tensor at its
stored size, quantized blocks included) and what of that is resident now. They differ right
after a warm start, when the weights are mapped from the weight cache's file and paged in on
first use: a start that reads the preemption profile from the cache runs no forward pass, and
the resident figure alone read "weights 0.01 GiB" for a 0.09 GiB model.
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
MiB = 1 << 20
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
    """Every weight form's tensor (parameters, quantized blocks among them, buffers such as the
    rotary tables, a method's own tensors), and the bytes of the opaque (oneDNN-packed) ones."""
    tensors = [param.data for param in {id(p): p for p in model.parameters()}.values()]
    tensors += list(model.buffers())
    methods = {id(m.quant_method): m.quant_method for m in method_layers(model).values()}
    opaque = 0
    for method in methods.values():
        tensors += method.extra_tensors()
        opaque += method.extra_bytes()
    return tensors, opaque


def _spans(tensors: Iterable[torch.Tensor | None], device: torch.device) -> list[tuple[int, int]]:
    """The byte ranges of the tensors' storages on `device`, merged: storage shared by views, a
    tied table or a packed weight's parts counts once."""
    ranges = sorted(
        (t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
        for t in tensors
        if t is not None and t.device == device and t.layout == torch.strided and t.numel()
    )
    merged: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _handed_back(model: nn.Module, mappings: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The float weights inside a cache file mapping whose pages went back to the file once
    oneDNN packed a copy (`weight_cache.release_unread_pages`): nothing reads them again."""
    spans = []
    for layer in {id(m.quant_method): m for m in method_layers(model).values()}.values():
        w = layer.weight.data
        if getattr(layer.quant_method, "packed", None) is not None and w.device.type == "cpu":
            lo, hi = w.data_ptr(), w.data_ptr() + w.numel() * w.element_size()
            if any(a <= lo and hi <= b for a, b, _ in mappings):
                spans.append((lo, hi))
    return spans


def weight_bytes(model: nn.Module, mappings: list[tuple[int, int, int]] | None = None) -> int:
    """The memory the model's weights take once read: every tensor it holds at its stored size
    (GGUF blocks as packed bytes, not as parameters' element counts of a float model) and
    oneDNN's packed copies, less the float pages those copies replaced in the weight cache's
    file. Not what is resident now: weights mapped from the weight cache are read in on first
    use, so right after start-up most of them are not (see `MemoryBudget.weights_resident`)."""
    device = next(model.parameters()).device
    tensors, opaque = _weight_tensors(model)
    if mappings is None:
        mappings = cache_file_mappings() if _LINUX else []
    total = sum(hi - lo for lo, hi in _spans(tensors, device))
    total -= sum(hi - lo for lo, hi in _handed_back(model, mappings))
    return total + opaque


def format_bytes(n: int) -> str:
    """GiB from 1 GiB up, else MiB: a small model's 92 MiB of weights, not "0.09 GiB"."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes, resident on the host unless `device` says the weights and KV cache live there."""

    weights: int  # what the weights take once read (`weight_bytes`)
    weights_resident: int  # of which in memory now (pages of the weight cache's file not read yet are not)
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
        on_host = self.weights_resident + self.kv_cache if self.device == "cpu" else 0
        return self.rss - on_host - self.swap_pool

    def __str__(self) -> str:
        def gib(n: int | None) -> str:
            return "?" if n is None else format_bytes(n)

        where = "" if self.device == "cpu" else f" on {self.device}"
        return (
            f"Memory: weights {gib(self.weights)} ({gib(self.weights_resident)} of it resident), "
            f"KV cache {gib(self.kv_cache)}{where} (of {gib(self.kv_cache_reserved)} reserved), "
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
        resident = mapped + pages.resident_bytes(tensors) + opaque
        kv_cache = pages.resident_bytes(kv_pools)
    else:  # on the device every byte allocated is taken
        resident = sum(hi - lo for lo, hi in _spans(tensors, device))
        kv_cache = sum(t.numel() * t.element_size() for t in kv_pools)
    return MemoryBudget(
        weights=weight_bytes(model, mappings),
        weights_resident=resident,
        kv_cache=kv_cache,
        kv_cache_reserved=sum(t.numel() * t.element_size() for t in kv_pools),
        swap_pool=pages.resident_bytes(swap_pools),
        swap_pool_reserved=sum(t.numel() * t.element_size() for t in swap_pools),
        rss=process_rss(),
        device=str(device),
    )
