"""Calibrating a CPU profile (`cpu`, `cpu-1b`): time real steps of its model, fit a linear step cost.

Short calibration traces, shaped like the figures' but drawn with their own seed, are served by
the real engine on the profile's threads (`real.py`), with paged memory and with Orca-Max so that batches
of every size occur; each step's work (`costs.StepWork`) and CPU time are recorded, and least
squares fits
    seconds = c_step + c_prefill * prompt tokens + c_decode * decoding sequences + c_kv * KV tokens read.
Block copies and swaps are priced from the engine's own start-up measurement of swapping a
block out and back in (on a CPU both are memory copies).

The fit is saved in the results folder (`calibration_<profile>.json`) with the CPU, model and
threads it was measured on, and reused while those and the scale match (`--recalibrate` forces
a new one).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from pagedllm.bench.paper.costs import LinearCost, Scale, StepWork
from pagedllm.bench.report import cpu_description

def calibration_file(profile: str) -> str:
    return f"calibration_{profile}.json"
# (dataset, requests, rate in req/s) of the traces served to calibrate.
CALIBRATION_TRACES = (("sharegpt", 16, 1.5), ("alpaca", 24, 4.0))
FEATURES = ("c_step", "c_prefill", "c_decode", "c_kv")


def _features(work: StepWork) -> list[float]:
    return [1.0, work.prefill_tokens, work.decode_seqs, work.kv_tokens_read]


def fit(samples: list[tuple[StepWork, float]]) -> tuple[dict[str, float], dict]:
    """Least-squares coefficients (none negative: a negative one is dropped and the rest refit)
    and how well they explain the samples. Plain least squares on seconds: what a simulation
    needs right is the sum of many steps' times."""
    import numpy as np

    x = np.array([_features(w) for w, _ in samples], dtype=float)
    y = np.array([t for _, t in samples], dtype=float)
    active = list(range(len(FEATURES)))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    full = np.zeros(len(FEATURES))
    full[active] = np.clip(coef, 0, None)
    predicted = x @ full
    residual = y - predicted
    quality = {
        "num_steps": len(samples),
        "r2": float(1 - (residual**2).sum() / max(1e-30, ((y - y.mean()) ** 2).sum())),
        "mean_abs_error_pct": float(100 * np.mean(np.abs(residual) / y)),
        "total_error_pct": float(100 * (predicted.sum() - y.sum()) / y.sum()),
    }
    return dict(zip(FEATURES, map(float, full))), quality


def measure_steps(engine, scale: Scale, length_scale: dict[str, float]) -> list[tuple[StepWork, float]]:
    """Serve calibration traces (their own seed, apart from the figures') on the real model,
    with paged memory (large batches) and Orca-Max (small ones); every step's work and time."""
    from pagedllm.bench.paper.real import run_real
    from pagedllm.bench.paper.traces import make_trace, workload

    samples: list[tuple[StepWork, float]] = []
    warm_up = make_trace(workload("alpaca", 2, scale.max_model_len, seed=2), rate=100.0)
    run_real(engine, "warm-up", "paged", warm_up, 100.0)
    for dataset, num_requests, rate in CALIBRATION_TRACES:
        requests = workload(dataset, num_requests, scale.max_model_len, length_scale[dataset], seed=1)
        trace = make_trace(requests, rate, seed=1)
        for policy in ("paged", "orca-max"):
            samples += run_real(engine, "calibration", policy, trace, rate)[1]
    return samples


def calibrate(scale: Scale, length_scale: dict[str, float], model: str | None = None, threads: int = 1,
              name: str = "cpu") -> tuple[LinearCost, dict, list[tuple[StepWork, float]]]:
    from pagedllm.bench.paper.real import build_engine

    start = time.perf_counter()
    # A small swap space, only for the engine's measurement of swapping a block.
    engine = build_engine(scale, swap_space=0.05, model=model, threads=threads)
    swap_block, _ = engine.executor.profile_preemption_costs()  # one block out and back in
    samples = measure_steps(engine, scale, length_scale)
    engine.shutdown()
    coefficients, quality = fit(samples)
    per_token_one_way = swap_block / (2 * scale.block_size)
    cost = LinearCost(
        name=name, **coefficients, c_copy_token=per_token_one_way, c_swap_token=per_token_one_way,
        block_size=scale.block_size, fit=quality,
    )
    quality["seconds"] = time.perf_counter() - start
    return cost, quality, samples


def model_key(model: str | None) -> dict:
    """What identifies the calibrated model: its path, and its size and time where it is a file."""
    if model is None:
        return {"model": "default"}
    path = Path(model)
    stat = path.stat() if path.is_file() else None
    return {"model": str(path.resolve()), "bytes": stat.st_size if stat else None,
            "mtime": int(stat.st_mtime) if stat else None}


def load_or_calibrate(
    scale: Scale, length_scale: dict[str, float], results_dir: Path, recalibrate: bool = False,
    name: str = "cpu", model: str | None = None, threads: int = 1,
) -> LinearCost:
    path = Path(results_dir) / calibration_file(name)
    cpu, _ = cpu_description()
    key = {"cpu": cpu, "scale": scale.__dict__, "model": model_key(model), "threads": threads}
    if path.exists() and not recalibrate:
        saved = json.loads(path.read_text())
        if all(saved.get(k) == v for k, v in key.items()):
            print(f"{name} profile: calibration from {path} (--recalibrate to measure again)")
            return LinearCost(**saved["cost"])
    print(f"{name} profile: calibrating the step cost on the real model ...", flush=True)
    cost, quality, samples = calibrate(scale, length_scale, model, threads, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    steps = [{**asdict(work), "seconds": seconds} for work, seconds in samples]
    saved = {**key, "cost": cost.describe(), "fit": quality, "steps": steps}
    path.write_text(json.dumps(saved, indent=2))
    print(
        f"{name} profile: step = {cost.c_step * 1e3:.2f} ms + {cost.c_prefill * 1e3:.3f} ms/prompt token + "
        f"{cost.c_decode * 1e3:.3f} ms/decoding sequence + {cost.c_kv * 1e6:.3f} us/KV token read "
        f"(R^2 {quality['r2']:.3f}, mean error {quality['mean_abs_error_pct']:.1f}% over {quality['num_steps']} steps); "
        f"wrote {path}"
    )
    return cost
