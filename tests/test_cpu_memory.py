"""A CPU worker keeps freed memory (`worker.cpu_memory`): a step's temporaries reuse the pages the
last step freed instead of faulting in fresh ones. Each case runs in a fresh interpreter, whose
glibc malloc has not yet been tuned by anything else in the test session."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Steps of varying sizes, as an engine runs them (a prompt of 2048 tokens, then decodes of a few
# rows, then another prompt), each an MLP over two layers: its temporaries (the largest 25 MB)
# freed as the layer goes. The page faults of the second round of steps are what a running
# engine pays again and again. One thread: a second thread's own malloc arena grows by 24 MiB
# (6,144 faults) in the second round in about half the runs at two threads, whatever the setting,
# which is glibc's per-thread arena, not the main heap these settings keep.
_SCRIPT = """
import json, resource, sys
import torch
torch.set_num_threads(1)
from pagedllm.worker.cpu_memory import keep_freed_memory
took = keep_freed_memory() if sys.argv[1] == "keep" else None
torch.manual_seed(0)
gate_up, down = torch.randn(3072, 576) * 0.01, torch.randn(576, 1536) * 0.01
def step(rows):
    h = torch.ones(rows, 576)
    for layer in range(2):
        gu = torch.nn.functional.linear(h, gate_up)
        a = torch.nn.functional.silu(gu[:, :1536]) * gu[:, 1536:]
        del gu
        h = h + torch.nn.functional.linear(a, down)
        del a
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for rows in (2048, 64, 1200, 32, 700, 48, 2000, 16, 300, 8, 1500):
        step(rows)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"took": took, "faults": [faults(), faults(), faults()]}))
"""


def _faults(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_steps_of_varying_sizes_reuse_the_pages_earlier_steps_freed():
    kept, default = _faults("keep"), _faults("default")
    assert kept["took"] is True
    # The first round touches fresh pages; the later ones reuse pages the heap kept. Without it,
    # glibc maps many of these temporaries afresh and unmaps them on free, how many depending on
    # the order of sizes its adaptive threshold has seen (2k-30k faults per round on the 2-core
    # Xeon, 12k-34k on a Zen 5 VM). Kept, the later rounds took 0 faults in fresh processes on
    # that VM, and 6,144 a round (one 24 MiB temporary faulted afresh) in some runs inside the test
    # suite and CI: so the later rounds are compared with the default's in the same environment,
    # at most half of them. The settings themselves are checked deterministically below.
    assert kept["faults"][0] > 2000, kept
    assert sum(kept["faults"][1:]) <= sum(default["faults"][1:]) / 2, (kept, default)


# In a fresh process, malloc's first request of 20 MiB: by default above glibc's initial mmap
# threshold (128 KiB), so mapped on its own (mallinfo2's hblkhd) and unmapped on free; kept, it
# comes from the heap (arena), which keeps it after the free.
_MALLINFO = """
import ctypes, json, sys
from pagedllm.worker.cpu_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
libc = ctypes.CDLL(None)
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
before = libc.mallinfo2()
block = libc.malloc(20 << 20)
mapped = libc.mallinfo2().hblkhd - before.hblkhd
libc.free(block)
print(json.dumps({"mapped": mapped, "heap_kept": libc.mallinfo2().arena - before.arena}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
@pytest.mark.parametrize("mode", ["keep", "default"])
def test_a_large_temporary_comes_from_the_heap_and_stays_there(mode):
    done = subprocess.run([sys.executable, "-c", _MALLINFO, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout.strip().splitlines()[-1])
    if mode == "keep":
        assert info["mapped"] == 0 and info["heap_kept"] >= (20 << 20), info
    else:
        assert info["mapped"] >= (20 << 20), info
