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
# engine pays again and again.
_SCRIPT = """
import json, resource, sys
import torch
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
    # Without it, glibc maps many of these temporaries afresh and unmaps them on free (its
    # threshold for that follows the sizes freed last): every round faults tens of MiB again.
    assert min(default["faults"][1:]) > 5000, default
    # With it, the first round touches fresh pages and the next ones reuse them (a few stray
    # faults from torch's threads aside).
    assert kept["faults"][0] > 2000, kept
    assert max(kept["faults"][1:]) < min(default["faults"][1:]) / 10, (kept, default)
