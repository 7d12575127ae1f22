"""The number of threads a CPU worker computes with, fitted to the cores other processes leave.

Every parallel region of a step (each projection, each attention call, each C++ kernel) splits
its work evenly between the OpenMP threads and ends when the last of them does. When another
process keeps a core busy, the operating system deschedules one of the threads for a time slice
(milliseconds) in most regions, and a decode step of hundreds of regions runs 20-40 times slower
(two threads on two cores beside one busy process; `pagedllm bench latency` shows it). With one
thread fewer, nothing waits for a descheduled thread.

`ThreadGovernor.adjust()` runs between steps. About once a second it reads how much CPU time the
machine spent, in all (`/proc/stat`, steal time included: another virtual machine's), and how
much this process did (`/proc/self/stat`); the difference is the other processes' load, in
cores. The thread count drops at once to the cores they leave free, and climbs back one thread
at a time only after three quiet readings in a row, so a load that comes and goes does not make
it oscillate. It never exceeds the count the worker started with (OMP_NUM_THREADS, or torch's
default). Off with `adapt_cpu_threads=False`, and in batch-invariant mode.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

import torch

from pagedllm.utils import load_between, read_cpu_times

logger = logging.getLogger("pagedllm")

INTERVAL_S = 1.0
# Other processes' load (cores) that costs a thread: a core busy a quarter of the time already
# deschedules a thread in many regions of a step.
BUSY_CORE = 0.25
QUIET_READINGS = 3


def threads_for(others_load: float, max_threads: int, cores: int) -> int:
    """Threads that leave the other processes' load its cores: a load past BUSY_CORE costs one
    thread, past 1 + BUSY_CORE two, and so on; at least one thread."""
    lost = max(0, math.ceil(others_load - BUSY_CORE))
    return max(1, min(max_threads, cores - lost))


class ThreadGovernor:
    def __init__(self, max_threads: int | None = None, cores: int | None = None,
                 reader: Callable[[], tuple[float, float]] = read_cpu_times,
                 clock: Callable[[], float] = time.monotonic, set_threads: Callable[[int], None] = torch.set_num_threads):
        self.max_threads = max_threads or torch.get_num_threads()
        self.cores = cores or len(os.sched_getaffinity(0))
        self.threads = self.max_threads
        self.reader, self.clock, self.set_threads = reader, clock, set_threads
        self.quiet = 0
        self.last_time = clock()
        self.last_busy, self.last_own = reader()

    def adjust(self) -> int:
        """Re-fit the thread count if a reading is due; returns the count in force."""
        now = self.clock()
        if now - self.last_time < INTERVAL_S:
            return self.threads
        busy, own = self.reader()
        others = load_between((self.last_time, self.last_busy, self.last_own), (now, busy, own))
        self.last_time, self.last_busy, self.last_own = now, busy, own
        target = threads_for(others, self.max_threads, self.cores)
        if target < self.threads:
            self.quiet = 0
            self._set(target, others)
        elif target > self.threads:
            self.quiet += 1
            if self.quiet >= QUIET_READINGS:
                self.quiet = 0
                self._set(self.threads + 1, others)
        else:
            self.quiet = 0
        return self.threads

    def _set(self, threads: int, others: float) -> None:
        logger.info("Other processes keep %.1f of %d cores busy: computing with %d thread%s (of %d).",
                    others, self.cores, threads, "" if threads == 1 else "s", self.max_threads)
        self.threads = threads
        self.set_threads(threads)
