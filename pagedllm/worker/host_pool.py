"""The KV cache's memory on a CPU device: one anonymous mapping for every layer's pools, faulted
in by a background thread instead of zeroed before the server is ready.

Zeroing a 2 GiB cache with `torch.zeros` takes 2-4 s at start-up on a 2-core machine: the time
goes in half a million page faults, each of which the kernel answers with a zeroed page. An
anonymous mapping's pages are zero already, so nothing needs writing: a thread asks the kernel to
map them all (`MADV_POPULATE_WRITE`, Linux 5.14+) while the server starts answering, and the
budget is really taken a few seconds after start-up rather than on first use. Pages the engine
writes meanwhile are simply already there; populating never changes a byte.

Before mapping, the pool is checked against the memory the system has available, so a budget
that cannot be met is refused with the numbers, not left to the OOM killer later.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import sys
import threading

import torch

logger = logging.getLogger("pagedllm")

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux's value (3.11's mmap lacks it)
_POPULATE_CHUNK = 256 << 20  # bytes per call, so the thread can stop between calls at shutdown


def available_memory() -> int:
    """Bytes of memory the OS can still give us (MemAvailable), or a large number if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62


class HostKVPools:
    """`count` zero-filled tensors of `shape` in one anonymous mapping, populated in the background."""

    def __init__(self, count: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        numel = math.prod(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.nbytes = count * numel * itemsize
        self._stop = threading.Event()
        self.populated = threading.Event()
        if self.nbytes == 0:
            self.tensors = [torch.zeros(shape, dtype=dtype) for _ in range(count)]
            self.populated.set()
            return
        available = available_memory()
        if self.nbytes > available:
            raise MemoryError(
                f"The KV cache needs {self.nbytes / (1 << 30):.2f} GiB but this machine has "
                f"{available / (1 << 30):.2f} GiB available: lower kv_cache_memory (--kv-cache-memory), "
                f"num_gpu_blocks or max_model_len, or free memory."
            )
        self._mapping = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        flat = torch.frombuffer(self._mapping, dtype=dtype)
        self.tensors = [flat[i * numel : (i + 1) * numel].view(shape) for i in range(count)]
        self._address = flat.data_ptr()
        self._thread = threading.Thread(target=self._populate, name="pagedllm-kv-populate", daemon=True)
        self._thread.start()

    def _populate(self) -> None:
        """Map every page now (ctypes releases the GIL for each call; Python's own mmap.madvise
        would hold it for seconds)."""
        if not sys.platform.startswith("linux"):
            self.populated.set()
            return
        libc = ctypes.CDLL(None, use_errno=True)
        for offset in range(0, self.nbytes, _POPULATE_CHUNK):
            if self._stop.is_set():
                return
            length = min(_POPULATE_CHUNK, self.nbytes - offset)
            if libc.madvise(ctypes.c_void_p(self._address + offset), ctypes.c_size_t(length), _MADV_POPULATE_WRITE):
                # An older kernel: pages are mapped as the cache fills instead.
                logger.debug("MADV_POPULATE_WRITE unavailable (errno %d); KV pages map on first use", ctypes.get_errno())
                break
        self.populated.set()

    def stop(self) -> None:
        self._stop.set()
