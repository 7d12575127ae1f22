"""Small helpers every layer may use. Imports nothing from the package and nothing heavy."""

from __future__ import annotations

import argparse
import functools
import platform
import time


def cdiv(a: int, b: int) -> int:
    """`a / b` rounded up, for positive `b` (how many blocks hold `a` tokens); element-wise on
    numpy arrays too."""
    return -(-a // b)


def best_wall_time(fn, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of `fn`, after one warm-up call (host clock)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_cpu_times() -> tuple[float, float]:
    """(seconds of CPU time the whole machine has spent busy, seconds this process has), since boot
    (Linux's /proc; steal time counts as busy: another virtual machine's)."""
    import os

    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal: busy is all but idle and iowait.
    busy = sum(fields[:8]) - fields[3] - fields[4]
    with open("/proc/self/stat") as f:
        after_name = f.read().rpartition(")")[2].split()
    own = int(after_name[11]) + int(after_name[12])  # utime, stime
    return busy / ticks, own / ticks


def load_mark() -> tuple[float, float, float] | None:
    """A mark to measure other processes' load from (`others_load`); None where /proc is not."""
    try:
        return (time.monotonic(), *read_cpu_times())
    except (OSError, ValueError, IndexError):
        return None


def others_load(mark: tuple[float, float, float] | None) -> float:
    """Cores other processes (and other virtual machines, by steal time) kept busy on average
    since `mark`; 0.0 where it cannot be read."""
    now = load_mark()
    return load_between(mark, now) if mark is not None and now is not None else 0.0


def load_between(mark: tuple[float, float, float], now: tuple[float, float, float]) -> float:
    """Other processes' cores busy between two (time, machine busy, own) readings; 0.0 for none elapsed."""
    if now[0] <= mark[0]:
        return 0.0
    return max(0.0, (now[1] - mark[1]) - (now[2] - mark[2])) / (now[0] - mark[0])


def release_free_memory() -> None:
    """Ask the C allocator to give freed heap pages back to the system (glibc keeps them
    otherwise, and they count in the process's resident memory); nothing where it is not glibc."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def heap_bytes_in_use() -> int | None:
    """Bytes the C allocator has handed out and not had back (every arena, and its mapped
    blocks: glibc's `mallinfo2`); None where it is not glibc. Process-wide."""
    import ctypes

    class _Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return None
    mallinfo2.restype = _Info
    info = mallinfo2()
    return info.uordblks + info.hblkhd


@functools.cache
def cpu_model_and_flags() -> tuple[str, str]:
    """This CPU's model name and feature flags as /proc/cpuinfo gives them (the platform's
    processor name and no flags where there is none)."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                found.setdefault(key.strip(), value.strip())
                if "model name" in found and "flags" in found:
                    break
    except OSError:
        pass
    return found.get("model name", platform.processor() or platform.machine() or "unknown"), found.get("flags", "")


class ExactArgumentParser(argparse.ArgumentParser):
    """An `ArgumentParser` whose options match only as spelled: no abbreviations. argparse expands
    a prefix to the one option it starts (`--max-num` to `--max-num-seqs`), and even with
    `allow_abbrev=False` it still expands a single-dash one (`-t 2` became `-tp 2`: two tensor-
    parallel processes for a llama-server user asking for two threads). Its subcommands' parsers
    are of this class too (argparse makes them of their parent's class)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def _get_option_tuples(self, option_string: str) -> list:
        # Keep only an option spelled in full with its value attached (`-n5`); drop the options
        # that merely start with what was typed.
        return [match for match in super()._get_option_tuples(option_string) if option_string.startswith(match[1])]
