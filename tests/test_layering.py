"""Imports flow one way: each layer imports only the layers below it (the layer table of
docs/architecture.md), and the front end of the engine never loads torch."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pagedllm"

# Modules every layer may import; they import only each other.
LEAVES = {"config", "sampling_params", "pooling_params", "outputs", "utils", "paths", "kv_spec", "field_types"}
# The control messages between the engine and the workers: plain data that lives in core/ and
# that the layers below the engine may read (nothing else of core/).
MESSAGES = {"pagedllm.core.scheduler_output", "pagedllm.core.model_output"}
READS_MESSAGES = "the messages of core/"
# Each top-level package and what it may import, besides the leaves (top to bottom).
ALLOWED = {
    "__main__": {"cli"},
    "__init__": {"engine", "entrypoints"},  # `LLM` and `LLMEngine`, loaded on first use
    "cli": {"bench", "entrypoints", "engine", "distributed"},
    # bench/paper drives the scheduler and block managers of core/ itself (its simulated clock).
    "bench": {"entrypoints", "engine", "core", "transformers_utils", "model", "attention", "kernels"},
    "entrypoints": {"engine"},
    # engine/constraints.py loads structured/ (xgrammar, torch) only when a request needs it.
    "engine": {"core", "executor", "transformers_utils", "structured"},
    "core": set(),
    "executor": {"worker", "distributed", READS_MESSAGES},
    "worker": {"model", "attention", "sampling", "distributed", "transformers_utils", READS_MESSAGES},
    "model": {"attention", "kernels", "distributed", "transformers_utils"},
    "sampling": {"kernels", READS_MESSAGES},
    "attention": {"kernels"},
    "kernels": set(),
    "distributed": set(),
    "transformers_utils": set(),
    # Grammars and token bitmasks on xgrammar; it reads a request's spec (a leaf) and nothing else.
    "structured": set(),
}


def _imports(path: Path, package_root: Path) -> set[str]:
    """Absolute names of the package modules `path` imports (at any depth of the file)."""
    module = ".".join(path.relative_to(package_root.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
    return {name for name in names if name.startswith("pagedllm.")}


def layering_violations(package_root: Path) -> list[str]:
    """Every import of a package module that its layer may not make, as 'file -> module'."""
    violations = []
    for path in sorted(package_root.rglob("*.py")):
        parts = path.relative_to(package_root).with_suffix("").parts
        layer = parts[0]
        for name in sorted(_imports(path, package_root)):
            target = name.split(".")[1]
            if target == layer or target in LEAVES:
                continue
            if layer in LEAVES:
                violations.append(f"{path.relative_to(package_root)} -> {name} (a leaf module imports only leaves)")
                continue
            allowed = ALLOWED.get(layer)
            if allowed is None:
                violations.append(f"{path.relative_to(package_root)}: the layer {layer!r} is not in the layering table")
                break
            if target in allowed or (READS_MESSAGES in allowed and name in MESSAGES):
                continue
            violations.append(f"{path.relative_to(package_root)} -> {name}")
    return violations


def test_every_import_goes_down_the_layers():
    assert layering_violations(PACKAGE) == []


def test_the_layering_table_has_no_cycles():
    graph = {layer: {t if t != READS_MESSAGES else "core" for t in allowed} for layer, allowed in ALLOWED.items()}
    visiting, done = set(), set()

    def visit(node: str, path: list[str]) -> None:
        assert node not in visiting, f"cycle: {' -> '.join(path + [node])}"
        if node in done:
            return
        visiting.add(node)
        for nxt in graph.get(node, ()):
            visit(nxt, path + [node])
        visiting.discard(node)
        done.add(node)

    for layer in graph:
        visit(layer, [])


@pytest.mark.parametrize(
    "planted",
    [
        "from pagedllm.engine.llm_engine import LLMEngine\n",  # core reaching up to the engine
        "import pagedllm.worker.worker\n",  # core reaching down past the engine
    ],
)
def test_an_upward_import_is_caught(tmp_path, planted):
    copy = tmp_path / "pagedllm"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "csrc"))
    target = copy / "core" / "scheduler.py"
    target.write_text(target.read_text() + "\n" + planted)
    violations = layering_violations(copy)
    assert len(violations) == 1 and violations[0].startswith("core/scheduler.py -> ")


def test_a_worker_may_read_the_messages_but_not_the_scheduler(tmp_path):
    copy = tmp_path / "pagedllm"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "csrc"))
    target = copy / "worker" / "cache_engine.py"
    target.write_text(target.read_text() + "\nfrom pagedllm.core.scheduler import Scheduler\n")
    assert layering_violations(copy) == ["worker/cache_engine.py -> pagedllm.core.scheduler"]


def _import_with_blocked(modules: list[str], blocked: list[str]) -> subprocess.CompletedProcess:
    code = (
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None  # any import of it now fails\n"
        f"for module in {modules!r}:\n"
        "    __import__(module)\n"
        "print('ok')\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_the_engine_front_end_imports_without_torch():
    """Output processing, beam search, the engine core (the step's owner, which the paper's
    simulator and the test harnesses drive), the engine class and model resolution need no
    torch, numpy or transformers until a model is actually loaded."""
    result = _import_with_blocked(
        [
            "pagedllm.engine.output_processor",
            "pagedllm.engine.beam_search",
            "pagedllm.engine.engine_core",
            "pagedllm.engine.requests",
            "pagedllm.bench.paper.simulator",
            "pagedllm.engine.llm_engine",
            "pagedllm.transformers_utils",
            "pagedllm.transformers_utils.families",  # every family's readers, tensor names and shapes
            "pagedllm.transformers_utils.file_checks",
            "pagedllm.kernels.build",
        ],
        ["torch", "numpy", "transformers"],
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
