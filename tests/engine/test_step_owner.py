"""The step is written once, in `EngineCore.step`: the front ends, the paper's simulator and every
test harness drive that class through an executor of their own, and only the scheduler writes
the block tables. Read from the source, so a harness that copies the step's order, or a module
that writes the KV cache manager itself, fails here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE_STEP = "pagedllm/engine/engine_core.py"
# What writes a block table, a CPU copy or the prefix cache (BlockManager, ReservationBlockManager).
WRITERS = {"allocate", "free", "fork", "swap_in", "swap_out", "commit", "rollback", "adopt_cached_prefix", "drain_pending"}


def _sources() -> dict[str, ast.Module]:
    files = [*ROOT.glob("pagedllm/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("benchmarks/**/*.py")]
    return {str(path.relative_to(ROOT)): ast.parse(path.read_text()) for path in files}


def _calls(tree: ast.Module):
    """(receiver's source text, method name) of every method call in the file."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            yield ast.unparse(node.func.value), node.func.attr


def test_only_the_engine_core_applies_a_steps_output():
    callers = {name for name, tree in _sources().items() for _, method in _calls(tree) if method == "update_from_output"}
    assert callers == {CORE_STEP}


def test_every_driver_of_output_processing_goes_through_the_engine_core():
    """Whoever builds an `OutputProcessor` hands it to an `EngineCore`, and nothing calls
    `process` on it but the core (the step's order lives in one place)."""
    for name, tree in _sources().items():
        constructed = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        if "OutputProcessor" in constructed and name != "pagedllm/engine/output_processor.py":
            assert "EngineCore" in constructed, f"{name} runs output processing without the engine core"
        for receiver, method in _calls(tree):
            assert not (method == "process" and "processor" in receiver), f"{name} calls {receiver}.process itself"


def test_only_core_writes_the_kv_cache_manager():
    for name, tree in _sources().items():
        if not name.startswith("pagedllm/") or name.startswith("pagedllm/core/"):
            continue
        for receiver, method in _calls(tree):
            if method in WRITERS and (receiver.endswith("block_manager") or receiver.split(".")[-1] == "bm"):
                raise AssertionError(f"{name} writes the KV cache manager: {receiver}.{method}()")


def test_the_checks_see_what_they_look_for():
    """The source readers find the calls they must find (else the tests above pass vacuously)."""
    sources = _sources()
    assert ("self.scheduler", "update_from_output") in set(_calls(sources[CORE_STEP]))
    scheduler_calls = set(_calls(sources["pagedllm/core/scheduler.py"]))
    assert ("bm", "fork") in scheduler_calls and ("self.block_manager", "allocate") in scheduler_calls
