"""The start-up measurement of preemption costs, kept between runs.

`preemption_mode="auto"` needs what swapping a block and recomputing a token cost on this
machine. Measuring it takes a few model runs at start-up (1 s on a quiet 2-core machine, 5-30 s
on a busy one), and a measurement taken while neighbours kept the cores busy is not what the
server will see. So it is measured once per machine, model and configuration, kept in the cache
folder as JSON, and read back by later starts: they start faster and decide the same way every
time (delete `profiles/` under the cache folder to measure again). `PAGEDLLM_MODEL_CACHE=0` measures on every start.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Callable
from pathlib import Path

import torch

from pagedllm.paths import cache_dir, model_cache_enabled
from pagedllm.transformers_utils.file_cache import entry_key, file_digest, read_json, write_json_entry

logger = logging.getLogger("pagedllm")

# Raise when the way the costs are measured changes: older entries are then ignored.
PROFILE_VERSION = 1


def model_identity(path: Path) -> str:
    """The model's content: a file's hash, or for a folder its weight files' names, sizes and times."""
    if path.is_file():
        return file_digest(path)
    stats = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.glob("*") if p.is_file())
    return entry_key(str(path.resolve()), stats)


def machine_identity() -> str:
    """The CPU (model and feature flags), torch's version and its thread count."""
    lines = []
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        pass
    return entry_key(platform.machine(), *lines, torch.__version__, torch.get_num_threads())


def cached_preemption_costs(parts: tuple, measure: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    """(swap seconds per block, recompute seconds per token) for the configuration `parts`:
    read from the cache folder, or measured and stored there."""
    if not model_cache_enabled():
        return measure()
    path = cache_dir() / "profiles" / f"preemption-{entry_key(PROFILE_VERSION, *parts)}.json"
    entry = read_json(path)
    if entry is not None:
        try:
            return float(entry["swap_s_per_block"]), float(entry["recompute_s_per_token"])
        except (KeyError, TypeError, ValueError):
            logger.debug("Ignoring a broken preemption profile %s", path)
    swap, recompute = measure()
    try:
        write_json_entry(path, {"swap_s_per_block": swap, "recompute_s_per_token": recompute, "parts": list(map(str, parts))})
    except OSError as exc:
        logger.debug("Could not keep the preemption profile (%s)", exc)
    return swap, recompute
