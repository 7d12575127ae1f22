"""Launch configurations of the Triton attention kernel, chosen by measurement on the GPU.

The kernel's launch shape (the key tile `tile_n`, `num_warps`, `num_stages` and the
flash-decoding split `num_partitions`) has no best value for every GPU, context and batch.
`benchmarks/gpu_autotune.py` times candidate configurations on the GPU, replayed from CUDA graphs
as the engine's decode steps run, per bucket of (kind, head size, GQA group, context, batch),
and writes the fastest of each bucket into a table:

    {"device": "NVIDIA H200", "triton": "3.4.0",
     "entries": [{"kind": "decode", "head_dim": 64, "group": 4, "context": 1024, "batch": 64,
                  "config": {"tile_n": 64, "num_warps": 4, "num_stages": 2, "num_partitions": 4},
                  "us": 41.0, "default_us": 55.2}]}

`kind` is "decode" (one query token per sequence; `batch` counts sequences) or "prompt" (any
other step; `batch` counts query tokens). The backend reads the table named by the
PAGEDLLM_TRITON_TUNING environment variable, else `pagedllm/kernels/tuning/<device>.json` for
the GPU's name, and takes for each step the entry of the same kind, head size and group whose
(context, batch) bucket is nearest on a log scale. Without a table or a matching entry, the
built-in heuristics of the backend choose, as they did before tables existed.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

TUNING_DIR = Path(__file__).resolve().parent.parent / "kernels" / "tuning"
ENV_VAR = "PAGEDLLM_TRITON_TUNING"
KINDS = ("decode", "prompt")
NUM_WARPS = (1, 2, 4, 8, 16)
MAX_STAGES = 8


@dataclass(frozen=True)
class LaunchConfig:
    """One launch shape. `num_partitions` None: the backend's heuristic splits the context."""

    tile_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    num_partitions: int | None = None

    def validate(self, where: str, max_partitions: int) -> LaunchConfig:
        def power_of_two(n) -> bool:
            return isinstance(n, int) and n >= 1 and n & (n - 1) == 0

        if not power_of_two(self.tile_n) or self.tile_n < 16:
            raise ValueError(f"{where}: tile_n must be a power of two >= 16, got {self.tile_n!r}")
        if self.num_warps not in NUM_WARPS:
            raise ValueError(f"{where}: num_warps must be one of {NUM_WARPS}, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= MAX_STAGES:
            raise ValueError(f"{where}: num_stages must be an integer in 1..{MAX_STAGES}, got {self.num_stages!r}")
        if self.num_partitions is not None and (
            not power_of_two(self.num_partitions) or self.num_partitions > max_partitions
        ):
            raise ValueError(f"{where}: num_partitions must be null or a power of two <= {max_partitions}, "
                             f"got {self.num_partitions!r}")
        return self


@dataclass(frozen=True)
class TuningEntry:
    kind: str
    head_dim: int
    group: int
    context: int
    batch: int
    config: LaunchConfig


class TuningTable:
    """The measured configurations of one GPU (see the module's docstring for the file)."""

    def __init__(self, entries: list[TuningEntry], device: str = "", source: str = "") -> None:
        self.entries = entries
        self.device = device
        self.source = source

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, kind: str, head_dim: int, group: int, context: int, batch: int) -> LaunchConfig | None:
        """The configuration of the nearest (context, batch) bucket of this kind, head size and
        group (distance: the sum of |log2| ratios; ties go to the larger bucket), or None."""
        candidates = [e for e in self.entries if (e.kind, e.head_dim, e.group) == (kind, head_dim, group)]
        if not candidates:
            return None

        def distance(e: TuningEntry) -> tuple[float, int, int]:
            d = abs(math.log2(max(context, 1) / e.context)) + abs(math.log2(max(batch, 1) / e.batch))
            return (d, -e.context, -e.batch)

        return min(candidates, key=distance).config

    def to_json(self, triton_version: str = "") -> dict:
        return {
            "device": self.device,
            "triton": triton_version,
            "entries": [
                {"kind": e.kind, "head_dim": e.head_dim, "group": e.group, "context": e.context, "batch": e.batch,
                 "config": asdict(e.config)}
                for e in self.entries
            ],
        }


def parse_table(data: dict, source: str, max_partitions: int) -> TuningTable:
    """A table from its JSON form; a ValueError naming `source` and the field for anything else."""
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise ValueError(f"{source}: a Triton tuning table is an object with a list 'entries'")
    entries = []
    for i, raw in enumerate(data["entries"]):
        where = f"{source}: entries[{i}]"
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be an object")
        if raw.get("kind") not in KINDS:
            raise ValueError(f"{where}.kind must be one of {KINDS}, got {raw.get('kind')!r}")
        for name in ("head_dim", "group", "context", "batch"):
            if not isinstance(raw.get(name), int) or raw[name] < 1:
                raise ValueError(f"{where}.{name} must be a positive integer, got {raw.get(name)!r}")
        config = raw.get("config")
        if not isinstance(config, dict) or set(config) - {"tile_n", "num_warps", "num_stages", "num_partitions"}:
            raise ValueError(f"{where}.config must be an object of tile_n, num_warps, num_stages, num_partitions")
        launch = LaunchConfig(**config).validate(f"{where}.config", max_partitions)
        entries.append(TuningEntry(raw["kind"], raw["head_dim"], raw["group"], raw["context"], raw["batch"], launch))
    return TuningTable(entries, device=str(data.get("device", "")), source=source)


def device_file(device_name: str) -> Path:
    """Where the committed table of a GPU of this name lives."""
    return TUNING_DIR / (re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-").lower() + ".json")


def load_table(device_name: str, max_partitions: int) -> TuningTable | None:
    """The table of PAGEDLLM_TRITON_TUNING, else the committed one of `device_name`, else None."""
    path = Path(os.environ[ENV_VAR]) if os.environ.get(ENV_VAR) else device_file(device_name)
    if not path.is_file():
        if os.environ.get(ENV_VAR):
            raise ValueError(f"{ENV_VAR}={path} names no file; unset it or point it at a table that "
                             "benchmarks/gpu_autotune.py wrote")
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e}); rerun benchmarks/gpu_autotune.py to rewrite it") from None
    return parse_table(data, str(path), max_partitions)
