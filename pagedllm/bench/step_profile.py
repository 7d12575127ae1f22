"""Where a step's time goes, part by part, measured in place (`pagedllm bench latency --profile`).

`torch.profiler` sees torch operators only: the C++ kernels of `pagedllm/kernels` (attention,
KV writes, fused norms, rotary, SiLU, sampling) are opaque calls to it, and a decode step of a
small model is mostly such calls. Here each part's Python entry point is wrapped, for the
duration of the profile only, by a timer (`time.perf_counter_ns`; CPU kernels are synchronous,
on a GPU the wrapper synchronises the device). Nothing is installed otherwise: the engine runs
the very same functions, unwrapped, when no profile is taken.

Times are exclusive: a part nested in another (the projections inside the MLP, the KV write
inside attention) is subtracted from its parent, so the parts add up to the step. What no
wrapper covers (the layer loop, residual views, the executor's and engine's Python) is the
remainder, reported as `other`.

Steps whose layers run as one C++ call (`pagedllm.model.fused_layers`) have no Python entry
points inside it: there the C++ side times its parts itself, into counters the profile hands it
for its duration, and they are added to the same parts (gathering q, k and v out of the fused
projection, which the Python loop does by views, is its own part: `copies`).
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

# Each part and what it covers, in the order of the table.
PARTS = {
    "scheduler": "scheduling, block allocation, advancing sequences (engine)",
    "input_prep": "input ids, positions, block tables, slot mapping, attention plan",
    "embedding": "token embedding lookup",
    "norms": "RMSNorm (with the residual add)",
    "projections": "qkv, o, gate_up and down projections",
    "rotary": "rotary position embedding of queries and keys",
    "kv_write": "writing the step's keys and values into the paged cache",
    "attention": "paged attention over the cache",
    "mlp_activation": "SiLU(gate) * up",
    "copies": "q, k and v gathered out of the fused qkv projection (the C++ decoder step)",
    "lm_head": "output projection to the vocabulary (rows that sample; greedy and top-k tokens drawn with it)",
    "sampling": "logits to tokens, log-probabilities",
    "outputs": "output processing: detokenizing, stop checks, request outputs (engine)",
    "other": "the rest: Python between the parts (layer loop, views, executor, engine)",
}


# The part name of a whole fused call of the layers while it is timed.
_FUSED = "fused_layers"


@dataclass
class _Frame:
    part: str
    absorb: bool  # time of regions nested inside counts to this part
    child_ns: int = 0


@dataclass
class StepProfiler:
    """Accumulates exclusive nanoseconds per part while its hooks are installed (`installed`)."""

    sync_cuda: bool = False
    part_ns: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _stack: list[_Frame] = field(default_factory=list)

    def wrap(self, part: str, fn, absorb: bool = False):
        """`fn` timed as `part` (its nested regions' time subtracted, unless `absorb`)."""
        stack, part_ns, calls, sync = self._stack, self.part_ns, self.calls, self.sync_cuda

        def timed(*args, **kwargs):
            if stack and stack[-1].absorb:
                return fn(*args, **kwargs)
            frame = _Frame(part, absorb)
            stack.append(frame)
            start = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                if sync:
                    torch.cuda.synchronize()
                elapsed = time.perf_counter_ns() - start
                stack.pop()
                part_ns[part] += elapsed - frame.child_ns
                calls[part] += 1
                if stack:
                    stack[-1].child_ns += elapsed

        timed.__wrapped__ = fn
        return timed

    def reset(self) -> None:
        self.part_ns.clear()
        self.calls.clear()

    @contextmanager
    def installed(self, engine):
        """Wrap every part's entry point for the enclosed code; everything is restored after,
        even on error."""
        saved = []
        fused = _in_process_worker(engine).model.fused_layers
        try:
            for owner, name, part, absorb in _hook_points(engine):
                original = owner.__dict__[name]
                saved.append((owner, name, original))
                setattr(owner, name, self.wrap(part, original, absorb))
            if fused is not None:
                fused.part_ns = (ctypes.c_int64 * len(fused.PARTS))()
            yield self
        finally:
            for owner, name, original in reversed(saved):
                setattr(owner, name, original)
            if fused is not None:
                self._add_fused_parts(fused.PARTS, fused.part_ns, len(fused.layers))
                fused.part_ns = None

    def _add_fused_parts(self, names, part_ns, num_layers: int) -> None:
        """The C++ parts of the fused calls, into the same parts; their calls as the loop would
        have made them (per layer: two norms, four projections, one of each other part; the token
        lookup once a call)."""
        fused_calls = self.calls.pop(_FUSED, 0)
        self.part_ns.pop(_FUSED, None)  # the whole call: what its parts leave is `other`
        per_call = {"norms": 2 * num_layers, "projections": 4 * num_layers, "embedding": 1}
        for name, ns in zip(names, part_ns):
            if name in PARTS and name != "other":
                self.part_ns[name] += ns
                self.calls[name] += fused_calls * per_call.get(name, num_layers)


def _hook_points(engine) -> list[tuple[object, str, str, bool]]:
    """(module or class, attribute, part, absorb) of every timed entry point of a step. Module
    globals are wrapped where callers look them up at call time (`linear` in layers.py)."""
    from pagedllm.attention import cpu as cpu_attention
    from pagedllm.attention.layer import Attention
    from pagedllm.model import fused_layers, layers, mlp, rotary

    worker = _in_process_worker(engine)
    backend_class = type(worker.backend)
    # The worker's and sampler's code is reached through the live objects: bench sits above the
    # engine and imports nothing of the layers below the executor.
    runner_module = sys.modules[type(worker.runner).__module__]
    points = [
        (runner_module, "build_attention_metadata", "input_prep", False),
        (cpu_attention, "_plan", "input_prep", False),
        (layers.VocabParallelEmbedding, "forward", "embedding", False),
        (layers.RMSNorm, "forward", "norms", False),
        (layers, "linear", "projections", False),
        (rotary.RotaryEmbedding, "forward", "rotary", False),
        (Attention, "forward", "attention", False),
        (mlp.GatedMLP, "forward", "mlp_activation", False),
        (layers.ParallelLMHead, "forward", "lm_head", True),
        (layers.ParallelLMHead, "sample", "lm_head", True),  # (a batch's tokens drawn with the product)
        (type(worker.runner.sampler), "__call__", "sampling", False),
        (fused_layers.FusedDecoderLayers, "__call__", _FUSED, True),
        (fused_layers.FusedDecoderLayers, "run_steady", _FUSED, True),  # (a decode step's call repeated)
    ]
    if worker.runner.decode_inputs is not None:  # decode steps' inputs, advanced in place
        points.append((type(worker.runner.decode_inputs), "build", "input_prep", False))
    owner = next(c for c in backend_class.__mro__ if "write_kv" in c.__dict__)
    return [*points, (owner, "write_kv", "kv_write", False)]


def _in_process_worker(engine):
    worker = getattr(engine.executor, "worker", None)
    if worker is None or worker.tp.size != 1:
        raise ValueError("--profile times the model in this process: run it with --tensor-parallel-size 1.")
    return worker


def profile_decode_steps(engine, num_steps: int) -> tuple[list[float], dict[str, float], dict[str, int]]:
    """Run up to `num_steps` engine steps with the hooks installed (the batch must already be
    past its prompts). Returns (each step's seconds, seconds per part summed over the steps,
    calls per part); the parts include the engine's scheduler and output times and `other`."""
    profiler = StepProfiler(sync_cuda=_in_process_worker(engine).device.type == "cuda")
    steps: list[float] = []
    before = engine.timer.snapshot()
    with profiler.installed(engine):
        for _ in range(num_steps):
            if not engine.has_unfinished_requests():
                break
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
    after = engine.timer.snapshot()
    parts = {part: profiler.part_ns.get(part, 0) / 1e9 for part in PARTS}
    parts["scheduler"] = after.scheduler - before.scheduler
    parts["outputs"] = after.outputs - before.outputs
    parts["other"] = sum(steps) - sum(v for k, v in parts.items() if k != "other")
    return steps, parts, dict(profiler.calls)


def profile_rows(steps: list[float], parts: dict[str, float], calls: dict[str, int]) -> list[dict]:
    """Table rows: milliseconds per step and share of the step for each part."""
    total = sum(steps)
    rows = []
    for part, what in PARTS.items():
        rows.append(
            {
                "part": part,
                "ms_per_step": 1e3 * parts[part] / len(steps),
                "pct": 100 * parts[part] / total,
                "calls_per_step": calls[part] / len(steps) if part in calls else "-",  # "-": not a hooked part
                "covers": what,
            }
        )
    rows.append({"part": "step (measured)", "ms_per_step": 1e3 * total / len(steps), "pct": 100.0, "calls_per_step": 1.0, "covers": ""})
    return rows
