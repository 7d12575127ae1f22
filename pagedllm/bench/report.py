"""Benchmark reports: an aligned table for people, JSON for scripts, and the machine they ran on
(machines of one kind differ: an AMD CPU with AVX2 only, an Intel one with AVX-512 and AMX)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path


def format_cell(value) -> str:
    """A table cell: floats to three decimals below 10, to one above (with thousands separators)."""
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return str(value)


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])
    cells = [[format_cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


# The CPU flags that decide which kernels run fast here.
SIMD_FLAGS = ("avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")


def cpu_description() -> tuple[str, list[str]]:
    """(CPU model name, the SIMD flags that matter to the kernels) from /proc/cpuinfo."""
    from pagedllm.utils import cpu_model_and_flags

    name, flags = cpu_model_and_flags()
    present = set(flags.split())
    return name, [flag for flag in SIMD_FLAGS if flag in present]


def machine() -> dict:
    import torch

    cpu, flags = cpu_description()
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_flags": flags,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def machine_line(info: dict | None = None) -> str:
    info = info or machine()
    return (
        f"cpu: {info['cpu']}; flags: {' '.join(info['cpu_flags']) or '-'}; "
        f"torch capability: {info['torch_cpu_capability']}; threads: {info['threads']}"
    )


def write_json(path: str | Path, name: str, config: dict, results) -> Path:
    """Write the report, and print the machine line beside the table every benchmark prints."""
    info = machine()
    print(machine_line(info))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": info,
        "config": config,
        "results": results,
    }
    path.write_text(json.dumps(payload, indent=2))
    return path
