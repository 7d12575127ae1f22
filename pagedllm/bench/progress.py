"""Progress lines for the benchmarks that run for minutes.

`bench serve` used to say nothing for 68 s, and a user cannot tell a slow run from a hung one.
Each long benchmark now says what phase it is in ("bench serve: sending 500 requests...") and,
within a phase, how far it got, at most once per `every_s` seconds ("bench serve: 120/500
requests done (34 s, about 108 s left)"). The lines go to stderr: stdout carries the tables and
the paths of the JSON written, which scripts read.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

# How often a phase's progress is said at most (and, with `update` called at least this often,
# at least).
EVERY_S = 10.0


class Progress:
    """The progress of one benchmark run, said on stderr as `<name>: <text>`."""

    def __init__(self, name: str, every_s: float = EVERY_S, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.every_s = every_s
        self._stream = stream  # None: sys.stderr as it is when a line is written (pytest swaps it)
        self._clock = clock
        self._phase_start = self._last = clock()

    def phase(self, what: str) -> None:
        """A new phase begins: always said, with "..." (its progress is timed from here)."""
        self._phase_start = self._clock()
        self._say(f"{what}...")

    def update(self, done: int, total: int | None = None, unit: str = "done", extra: str = "") -> bool:
        """`done` (of `total`) `unit` so far in this phase: said if `every_s` passed since the
        last line, or when the phase's work is all done after running that long (a short
        phase's end needs no line). Cheap to call every step; returns whether a line was written."""
        now = self._clock()
        elapsed = now - self._phase_start
        finished = done == total and elapsed >= self.every_s  # once: past the total, the time limit holds again
        if not finished and now - self._last < self.every_s:
            return False
        count = f"{done}/{total}" if total is not None else str(done)
        timing = f"{elapsed:.0f} s"
        if total is not None and 0 < done < total:
            timing += f", about {elapsed / done * (total - done):.0f} s left"
        self._say(f"{count} {unit} ({timing}){'; ' + extra if extra else ''}")
        return True

    def _say(self, text: str) -> None:
        print(f"{self.name}: {text}", file=self._stream or sys.stderr, flush=True)
        self._last = self._clock()
