"""Settings and helpers shared by the reliability scenarios."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.server.common import start_server_process

# The shared server's --body-idle-timeout: a client that stops sending its body gets 408 after
# this long (the default is 60 s).
BODY_IDLE_TIMEOUT_S = 5.0
# Servers started here compute on one thread. A tiny model gains nothing from two, and on a
# machine whose cores other processes keep busy, two OpenMP threads wait for each other at
# every parallel region while one of them is descheduled: steps then take 10-20x longer, and
# the timings would measure the neighbours.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@dataclass
class RunningServer:
    url: str
    process: subprocess.Popen
    log: list[str]  # its stderr after start-up, as it comes
    reader: threading.Thread

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_exit(self, timeout: float) -> tuple[int, str]:
        """Its exit status and whole log, once it has exited by itself."""
        status = self.process.wait(timeout)
        self.reader.join(10)
        return status, "".join(self.log)


@contextlib.contextmanager
def serving(model: Path, *flags: str) -> Iterator[RunningServer]:
    """`pagedllm serve` on one thread in a process of its own (start_server_process's flags),
    stopped with SIGTERM at the end (killed if it does not exit within 30 s)."""
    process, url, log, reader = start_server_process(model, *flags, env=ONE_THREAD)
    try:
        yield RunningServer(url, process, log, reader)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        reader.join(5)
