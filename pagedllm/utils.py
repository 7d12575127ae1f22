"""Small helpers every layer may use. Imports nothing from the package and nothing heavy."""

from __future__ import annotations

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
