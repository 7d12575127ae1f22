"""The CPU worker's C heap settings (`pagedllm.worker.heap`): freed activation-sized buffers are
reused instead of arriving as fresh pages that fault on first write."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import json, resource, sys, torch
if sys.argv[1] == "kept":
    from pagedllm.worker.heap import keep_freed_heap_memory
    assert keep_freed_heap_memory()
def cycle():  # a step's worth of large buffers, written, then all freed
    buffers = [torch.empty(5 << 20) for _ in range(4)]  # 4 x 20 MiB
    for b in buffers:
        b.fill_(1.0)
    del buffers
cycle(); cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
cycle()
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
"""


def _faults(mode: str) -> int:
    result = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and page-fault counts: Linux only")
def test_freed_buffers_are_reused_without_page_faults():
    default, kept = _faults("default"), _faults("kept")
    # 80 MiB of 4 KiB pages is 20480 first-touch faults; reused memory takes next to none.
    assert default > 10000, default
    assert kept < 1000, kept
