"""The start-up measurement of preemption costs, kept between runs.

`preemption_mode="auto"` needs what swapping a block and recomputing a token cost on this
machine. Measuring it takes a few model runs at start-up (1 s on a quiet 2-core machine, 5-30 s
on a busy one), and a measurement taken while neighbours kept the cores busy is not what the
server will see. So it is measured once per machine, model and configuration, kept in the cache
folder as JSON, and read back by later starts: they start faster and decide the same way every
time (delete `profiles/` under the cache folder to measure again). `PAGEDLLM_MODEL_CACHE=0` measures on every start.

Either way the log says so before start-up goes quiet: "Measuring preemption costs (...)..." and
then how long it took, or "Using the preemption costs measured on <date> (cache file ...)". An
entry that cannot be read (not JSON, fields missing or not positive numbers) is ignored with a
warning and measured again.
"""

from __future__ import annotations

import logging
import math
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedllm.paths import MODEL_CACHE_ENV, cache_dir, model_cache_enabled
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
        return _measure_logged(measure, f"not kept: {MODEL_CACHE_ENV}=0")
    path = cache_dir() / "profiles" / f"preemption-{entry_key(PROFILE_VERSION, *parts)}.json"
    kept = _read_entry(path)
    if kept is not None:
        swap, recompute, measured_on = kept
        logger.info("Using the preemption costs measured on %s: %s (cache file %s; delete it to measure again)",
                    measured_on, describe_costs(swap, recompute), path)
        return swap, recompute
    start = time.perf_counter()
    swap, recompute = _measure_logged(measure, f"kept for the next start in {path}")
    entry = {"swap_s_per_block": swap, "recompute_s_per_token": recompute, "parts": list(map(str, parts)),
             "measured_on": time.strftime("%Y-%m-%d %H:%M"), "seconds": round(time.perf_counter() - start, 3)}
    try:
        write_json_entry(path, entry)
    except OSError as exc:
        logger.debug("Could not keep the preemption profile (%s)", exc)
    return swap, recompute


def describe_costs(swap: float, recompute: float) -> str:
    """The two costs in words, as the start-up log gives them."""
    return f"{swap * 1e3:.3g} ms to swap a block out and in, {recompute * 1e3:.3g} ms to recompute a token"


def _measure_logged(measure: Callable[[], tuple[float, float]], kept: str) -> tuple[float, float]:
    """Measure, saying so before (the model runs for seconds, up to half a minute on a busy
    machine, with nothing else logged) and after."""
    logger.info("Measuring preemption costs on this machine (block swaps and two prefills: a few seconds, up to "
                "30 s on a busy machine; %s)...", kept)
    start = time.perf_counter()
    swap, recompute = measure()
    logger.info("Measured the preemption costs in %.1f s: %s", time.perf_counter() - start, describe_costs(swap, recompute))
    return swap, recompute


def _read_entry(path: Path) -> tuple[float, float, str] | None:
    """(swap, recompute, when measured) kept at `path`; None if there is none or it cannot be
    used (warned: a broken entry is measured again and overwritten)."""
    if not path.exists():
        return None
    entry = read_json(path)
    try:
        swap, recompute = float(entry["swap_s_per_block"]), float(entry["recompute_s_per_token"])
        if not (swap > 0 and 0 < recompute < math.inf):  # swap is inf where nothing can be swapped
            raise ValueError("not positive")
    except (KeyError, TypeError, ValueError):
        logger.warning("Ignoring the preemption-cost cache file %s (not a profile this version can read); "
                       "measuring again", path)
        return None
    measured_on = entry.get("measured_on")
    if not isinstance(measured_on, str):  # an entry from before the date was kept: the file's time
        measured_on = time.strftime("%Y-%m-%d %H:%M", time.localtime(path.stat().st_mtime))
    return swap, recompute, measured_on
