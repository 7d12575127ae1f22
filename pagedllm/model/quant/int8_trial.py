"""Where int8 activations pay: a trial per GGUF type's kernels, measured once per machine.

`int8_activations="auto"` (the default for GGUF-quantized models on a CPU) multiplies a
quantized projection on int8-quantized activations only for products of up to
`int8_rows_that_pay(qtype)` rows. That bound is measured on this machine, never read from a
table: int8 against float32 activations on random blocks of the type, at decode-sized row
counts and up to a prompt chunk's, the bound being the largest row count where int8 won along
with every smaller one (0 if it loses at 1 row; a loss counts when timed twice). Winning at the
largest trial size means every size (`EVERY_SIZE`).

The trial times the kernels, so its result holds for one CPU (model name and feature flags), one
kernel library (its file name hashes the C++ sources and this CPU's flags), the ISA path
(`gguf.isa()`) and the thread count, and is kept in the cache folder as
`int8-trials/<key>.json`, the key a hash of those conditions ("version", "conditions", "rows"
{qtype: rows}, "ways", "width_ways", "width_rows", and read_trial.py's "row_streams" and
"prefetch": how each thread reads a weight's rows, whatever the activations), so a later start on
the same machine reads it instead of timing again (logged).

The GGUF kernels have more than one int8 way for a type (`gguf.int8_ways(qtype)`: VNNI or AMX
beside the AVX2 way on AVX-512 CPUs, and everywhere the AVX2 way with every row of x alone,
"avx2_rows"), so the trial first times each per bucket of row counts (`gguf.INT8_WAY_BUCKETS`)
and sets the faster ("ways"): which wins where depends on the core, not on a threshold. It
depends on the row's width too: a row narrower than the trial's pays its fixed costs
(reductions, the constants' term) over fewer weights (Q8_0 at 1 row on a Zen 4 EPYC: 640 wide,
the AVX2 way 30% faster than VNNI; 2048 wide, a tie). So each narrower width a model's weights
have is timed too, at the decode buckets, on a weight of the trial's bytes
(`choose_width_ways`): its ways ("width_ways" {qtype: {in_features: {bucket: way}}}, set for that
width only; {} where the path has one way), and against float32 activations the rows up to which
int8 still pays there ("width_rows" {qtype: {in_features: rows}}; "auto" takes the lesser of the
type's bound and the width's). An entry that is not valid JSON, was measured under other
conditions or holds a result the trial cannot give is measured again, never fatal. A trial
during which other processes kept more than `BUSY_CORES` cores busy (`/proc/stat`, steal time
included) serves the process that ran it and is not kept. Delete `int8-trials/` under the cache
folder (`pagedllm.paths.cache_dir()`) to measure again.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pagedllm.kernels import gguf as gguf_kernels
from pagedllm.model.quant.gguf import EVERY_SIZE
from pagedllm.paths import cache_dir
from pagedllm.transformers_utils.file_cache import entry_key, read_json, write_json_entry
from pagedllm.utils import best_wall_time, cpu_model_and_flags, load_mark, others_load

logger = logging.getLogger("pagedllm")

# Raise when what the trial measures changes: older entries are then ignored (4: Q4_1 and Q8_0
# on the GGUF kernels' trial, where kernels/quant.py had its own).
TRIAL_VERSION = 4
# (out, in) of the GGUF kernels' trial: a 1B model's projection, past a core's L2 as the model's
# weights are (2 threads, Q4_K, AVX-512 VNNI, 8 rows: int8 lost on 1536 x 512, 0.166 against
# 0.160 ms, and won here, 0.72 against 0.92; the 1B model's step at batch 8: 129.0 -> 101.8 ms).
TRIAL_SHAPE = (4096, 2048)
# Decode batches (1-256 sequences: max_num_seqs' default is 256) and a prompt chunk of the engine's default
# step budget (max_num_batched_tokens, 2048 tokens): with the default configuration every product that takes
# int8 lies between two row counts where int8 was seen winning (the bound stood at 256 rows before, and prompt
# chunks of 257-2048 took int8 unseen). Winning at 2048 is taken to mean every size: only a budget set above
# the default then takes int8 at sizes not measured, as llama.cpp does for every product.
TRIAL_ROWS = (1, 4, 8, 16, 64, 256, 2048)


def _repeats(rows: int) -> int:
    """Timings per way at `rows`: best of 15 for decode sizes (on a loaded machine fewer let a
    descheduled thread decide); a product of hundreds of rows takes milliseconds, which one
    preemption moves by little, so three do there."""
    return 15 if rows <= 64 else 3


def measure(qtype: str) -> int:
    """Time the trial of `qtype`'s kernels now: the most rows up to which int8 activations beat
    float32's."""
    gen = torch.Generator().manual_seed(0)
    out_features, in_features = TRIAL_SHAPE
    w = gguf_kernels.random_weight(qtype, out_features, in_features, gen)
    pays, timings = 0, []
    for rows in TRIAL_ROWS:
        x = torch.randn(rows, in_features, generator=gen)
        for _ in range(2):  # a loss, kept for good, is timed twice (one kept "Q6_K loses at 1 row" cost a
            # Zen 5 VM's Qwen3-0.6B a third of its decode speed: 95 us on int8, 294 on float32 timed again)
            t_int8 = best_wall_time(lambda: gguf_kernels.matmul(x, w, int8=True), _repeats(rows))
            t_float = best_wall_time(lambda: gguf_kernels.matmul(x, w), _repeats(rows))
            if t_int8 < t_float:
                break
        timings.append(f"{rows} rows {t_int8 * 1e6:.0f} vs {t_float * 1e6:.0f} us")
        if t_int8 >= t_float:
            break
        pays = rows
    pays = EVERY_SIZE if pays == TRIAL_ROWS[-1] else pays
    logger.info("int8 activations for %s (%s): %s on a trial (%s)", qtype, gguf_kernels.isa(), describe(pays),
                "; ".join(timings))
    return pays


def choose_ways(qtype: str) -> dict[int, str]:
    """Time each int8 way of the GGUF kernels' path for `qtype` at every bucket of row counts
    (`gguf.INT8_WAY_BUCKETS`), on the trial's weight, and set the faster: {bucket: way}. {} where
    there is nothing to choose (one way on this path for the type)."""
    ways = gguf_kernels.int8_ways(qtype)
    if len(ways) < 2:
        return {}
    gen = torch.Generator().manual_seed(1)
    out_features, in_features = TRIAL_SHAPE
    w = gguf_kernels.random_weight(qtype, out_features, in_features, gen)
    chosen, timings = {}, []
    # One row is the same product either way; and rows alone, once it loses, only loses more at
    # larger buckets (each row decodes W again, where the groups share one decoding): not timed.
    alone_lost = False
    for rows in gguf_kernels.INT8_WAY_BUCKETS:
        x = torch.randn(rows, in_features, generator=gen)
        times = {}
        for way in [name for name in ways if name != "avx2_rows" or (rows > 1 and not alone_lost)]:
            gguf_kernels.set_int8_way(qtype, rows, way)
            times[way] = best_wall_time(lambda: gguf_kernels.matmul(x, w, int8=True), _repeats(rows))
        chosen[rows] = min(times, key=times.__getitem__)  # the path's own way on a tie
        alone_lost = alone_lost or ("avx2_rows" in times and chosen[rows] != "avx2_rows")
        gguf_kernels.set_int8_way(qtype, rows, chosen[rows])
        timings.append(f"{rows}: {chosen[rows]} (" + ", ".join(f"{way} {t * 1e6:.0f} us" for way, t in times.items()) + ")")
    logger.info("int8 ways for %s, by rows: %s", qtype, "; ".join(timings))
    return chosen


def set_ways(qtype: str, ways: dict[int, str]) -> None:
    """Set the int8 ways a trial chose for `qtype` (`choose_ways`)."""
    for rows, way in ways.items():
        gguf_kernels.set_int8_way(qtype, rows, way)


def choose_width_ways(qtype: str, in_features: int) -> tuple[dict[int, str], int]:
    """As `choose_ways` and `measure` for rows `in_features` wide (narrower than the trial's), at
    the decode buckets, on a weight of the trial's bytes: ({bucket: the faster int8 way, set for
    that width; {} where the path has one}, the rows up to which int8 beats float32 there with
    every smaller bucket, `EVERY_SIZE` where float32 never wins). A narrow row can lose where the
    trial's width wins (docs/gguf-kernels.md: Q8_0 and Q5_0 640 wide from 2 rows on a Zen 5 VM)."""
    ways = gguf_kernels.int8_ways(qtype)
    gen = torch.Generator().manual_seed(2)
    out_features = TRIAL_SHAPE[0] * TRIAL_SHAPE[1] // in_features
    w = gguf_kernels.random_weight(qtype, out_features, in_features, gen)
    chosen, timings, pays = {}, [], EVERY_SIZE
    for rows in (b for b in gguf_kernels.INT8_WAY_BUCKETS if b <= gguf_kernels.MAX_ROWS):
        x = torch.randn(rows, in_features, generator=gen)
        times = {}
        for way in [name for name in ways if name != "avx2_rows" or rows > 1] if len(ways) > 1 else [None]:
            if way is not None:  # (one row: the same product by avx2_rows)
                gguf_kernels.set_int8_way(qtype, rows, way, in_features)
            times[way] = best_wall_time(lambda: gguf_kernels.matmul(x, w, int8=True), _repeats(rows))
        best = min(times, key=times.__getitem__)
        if best is not None:
            chosen[rows] = best
            gguf_kernels.set_int8_way(qtype, rows, best, in_features)
        if pays == EVERY_SIZE:  # (once float32 won, the larger buckets only time the ways, for "on")
            times["float32"] = best_wall_time(lambda: gguf_kernels.matmul(x, w), _repeats(rows))
            pays = rows - 1 if times[best] >= times["float32"] else pays  # (a tie: float32, as the type's trial)
        timed = ", ".join(f"{name or 'int8'} {t * 1e6:.0f} us" for name, t in times.items())
        timings.append(f"{rows}: {best or 'int8'} ({timed})")
    logger.info("int8 activations for %s rows of %d: %s (by rows: %s)", qtype, in_features,
                "as the type's trial says" if pays == EVERY_SIZE else describe(pays), "; ".join(timings))
    return chosen, pays


def set_width_ways(qtype: str, in_features: int, ways: dict[int, str]) -> None:
    """Set the int8 ways a width's trial chose (`choose_width_ways`)."""
    for rows, way in ways.items():
        gguf_kernels.set_int8_way(qtype, rows, way, in_features)


def describe(rows: int) -> str:
    """A trial's result in words, for the log."""
    return ("used at every size" if rows == EVERY_SIZE else f"used up to {rows} rows" if rows
            else "not faster than float32, not used")


def conditions() -> dict:
    """What the trial's result depends on, as stored beside it."""
    from pagedllm.kernels.build import load

    name, flags = cpu_model_and_flags()
    return {
        "cpu": name,
        "flags": flags,
        "kernels": Path(load()._name).name,  # the library the trial times, whatever is on disk now
        "gguf_isa": gguf_kernels.isa(),
        "threads": torch.get_num_threads(),
        "trial": f"v{TRIAL_VERSION} {TRIAL_SHAPE} {TRIAL_ROWS}",
    }


def trial_path(conds: dict) -> Path:
    return cache_dir() / "int8-trials" / f"{entry_key(*sorted(conds.items()))}.json"


def _possible() -> set[int]:
    """Every result a trial can give."""
    return {0, *TRIAL_ROWS[:-1], EVERY_SIZE}


def _ways_of(stored, qtype: str) -> dict[int, str] | None:
    """A kept choice of ways as `choose_ways` gives it; None if it is not one."""
    if not isinstance(stored, dict):
        return None
    ways = {}
    for bucket, way in stored.items():
        if not (isinstance(bucket, str) and bucket.isdigit() and int(bucket) in gguf_kernels.INT8_WAY_BUCKETS
                and way in gguf_kernels.int8_ways(qtype)):
            return None
        ways[int(bucket)] = way
    return ways


def _stored(path: Path, conds: dict, quiet: bool = False) -> dict[str, tuple[int, dict[int, str]]]:
    """The results kept at `path` for these conditions, qtype -> (rows, ways); {} (logged unless
    `quiet`) for an entry that cannot be used; a type whose rows or ways are not a trial's is
    left out (measured again)."""
    entry = read_json(path)
    rows = entry.get("rows") if isinstance(entry, dict) else None
    ways = entry.get("ways") if isinstance(entry, dict) else None
    if rows is None or entry.get("version") != TRIAL_VERSION or entry.get("conditions") != conds \
            or not isinstance(rows, dict) or not isinstance(ways, dict):
        if path.exists() and not quiet:
            logger.warning("Ignoring the int8 trial cache %s (unreadable, or made under other conditions): "
                           "measuring again", path)
        return {}
    kept = {}
    for q, r in rows.items():
        chosen = _ways_of(ways.get(q), q)
        if isinstance(q, str) and type(r) is int and r in _possible() and chosen is not None:
            kept[q] = (r, chosen)
    return kept


def _stored_width_rows(path: Path, conds: dict) -> dict[str, dict[int, int]]:
    """The bounds kept at `path` for these conditions (`choose_width_ways`' rows), qtype ->
    {in_features: rows}; what a width's trial cannot give is left out."""
    stored = entry(path, conds).get("width_rows")
    possible = {EVERY_SIZE, *(b - 1 for b in gguf_kernels.INT8_WAY_BUCKETS if b <= gguf_kernels.MAX_ROWS)}
    kept: dict[str, dict[int, int]] = {}
    for qtype, widths in (stored.items() if isinstance(stored, dict) else ()):
        for width, rows in (widths.items() if qtype in gguf_kernels.TYPE_IDS and isinstance(widths, dict) else ()):
            if isinstance(width, str) and width.isdigit() and type(rows) is int and rows in possible:
                kept.setdefault(qtype, {})[int(width)] = rows
    return kept


def _stored_width_ways(path: Path, conds: dict) -> dict[str, dict[int, dict[int, str]]]:
    """The width ways kept at `path` for these conditions (an entry of `_stored`'s kind), qtype ->
    {in_features: ways}; what is not a choice of `choose_width_ways` is left out."""
    stored = entry(path, conds).get("width_ways")
    kept: dict[str, dict[int, dict[int, str]]] = {}
    for qtype, widths in (stored.items() if isinstance(stored, dict) else ()):
        if qtype not in gguf_kernels.TYPE_IDS or not isinstance(widths, dict):
            continue
        for width, ways in widths.items():
            chosen = _ways_of(ways, qtype)
            if isinstance(width, str) and width.isdigit() and chosen is not None:
                kept.setdefault(qtype, {})[int(width)] = chosen
    return kept


def entry(path: Path, conds: dict) -> dict:
    """The entry kept at `path` if it is one of this version measured under these conditions, else {}."""
    kept = read_json(path)
    ok = isinstance(kept, dict) and kept.get("version") == TRIAL_VERSION and kept.get("conditions") == conds
    return kept if ok else {}


OWN_KEYS = ("version", "conditions", "rows", "ways", "width_ways", "width_rows")  # (what `write` writes itself)


def write(path: Path, conds: dict, results: dict | None = None, width_ways: dict | None = None,
          others: dict | None = None, width_rows: dict | None = None) -> None:
    """Keep the trial's results for these conditions: what is given, and what the file holds (as
    another process may have stored it meanwhile) for the rest. Keys the trial does not write
    (read_trial.py's "row_streams" and "prefetch") are kept as the file holds them, `others`
    over them."""
    results = _stored(path, conds, quiet=True) if results is None else results
    width_ways = _stored_width_ways(path, conds) if width_ways is None else width_ways
    width_rows = _stored_width_rows(path, conds) if width_rows is None else width_rows
    kept = {key: value for key, value in entry(path, conds).items() if key not in OWN_KEYS}
    try:
        write_json_entry(path, {
            **kept, **(others or {}), "version": TRIAL_VERSION, "conditions": conds,
            "rows": {q: r for q, (r, _) in results.items()},
            "ways": {q: {str(b): way for b, way in w.items()} for q, (_, w) in results.items()},
            "width_ways": {q: {str(n): {str(b): way for b, way in w.items()} for n, w in widths.items()}
                           for q, widths in width_ways.items()},
            "width_rows": {q: {str(n): rows for n, rows in widths.items()} for q, widths in width_rows.items()}})
    except OSError as exc:
        logger.debug("Could not keep the int8 trial's result (%s)", exc)


# Other processes' load (cores, on average over a trial) past which the trial's timings serve
# this process but are not kept: a trial taken on a Zen 4 EPYC beside llama.cpp's build chose the
# VNNI way for Q4_K at 1 row and four row streams, where the same trial on the quiet machine chose
# the AVX2 way (the faster there) and one stream; kept, that choice would have stayed until the
# kernels changed.
BUSY_CORES = 0.25


def quiet_since(mark, what: str) -> bool:
    """Whether the machine stayed quiet enough since `mark` to keep what was timed; says why not."""
    load = others_load(mark)
    if load > BUSY_CORES:
        logger.warning("Other processes kept %.1f cores busy while %s was timed: the result serves this process "
                       "and is not kept (timed again at the next start)", load, what)
        return False
    return True


_results: dict[tuple[str, str], int] = {}  # per process: (the conditions' file, qtype) -> rows
_width_results: dict[tuple[str, str, int], int] = {}  # per process: (file, qtype, in_features) -> rows


def int8_rows_that_pay(qtype: str) -> int:
    """The most rows up to which int8 activations beat float32's for `qtype`'s kernels on this
    machine: from this process's memory, else the cache folder, else measured (and kept)."""
    conds = conditions()
    path = trial_path(conds)
    if (str(path), qtype) in _results:
        return _results[str(path), qtype]
    stored = _stored(path, conds)
    if qtype in stored:
        rows, ways = stored[qtype]
        set_ways(qtype, ways)
        logger.info("int8 activations for %s (%s): %s, measured on this CPU and kernel library before (%s; "
                    "delete it to measure again)", qtype, gguf_kernels.isa(), describe(rows), path)
    else:
        # Said before it starts: the trial takes seconds per type with nothing logged meanwhile.
        logger.info("Timing int8 against float32 activations for %s on this CPU (a few seconds; kept for the next "
                    "start in %s)...", qtype, path)
        mark = load_mark()
        ways = choose_ways(qtype)  # first: the rows where int8 pays are timed on the chosen ways
        rows = measure(qtype)
        if quiet_since(mark, f"int8 against float32 activations for {qtype}"):
            merged = {**_stored(path, conds, quiet=True), qtype: (rows, ways)}  # with what another process stored
            write(path, conds, merged)
    _results[str(path), qtype] = rows
    return rows


def set_ways_for_width(qtype: str, in_features: int) -> int:
    """Set the int8 ways of `qtype` rows `in_features` wide and return the rows up to which int8
    pays there (`choose_width_ways`): kept on this machine, else timed and kept; `EVERY_SIZE`,
    nothing timed, at the trial's width or wider."""
    if in_features >= TRIAL_SHAPE[1]:
        return EVERY_SIZE
    conds = conditions()
    path = trial_path(conds)
    key = (str(path), qtype, in_features)
    if key in _width_results:
        return _width_results[key]
    kept_ways, kept_rows = _stored_width_ways(path, conds), _stored_width_rows(path, conds)
    one_way = len(gguf_kernels.int8_ways(qtype)) < 2
    if in_features in kept_rows.get(qtype, {}) and (one_way or in_features in kept_ways.get(qtype, {})):
        set_width_ways(qtype, in_features, kept_ways.get(qtype, {}).get(in_features, {}))
        rows = kept_rows[qtype][in_features]
    else:
        logger.info("Timing int8 activations on %s rows of %d on this CPU (kept in %s)...", qtype, in_features, path)
        mark = load_mark()
        ways, rows = choose_width_ways(qtype, in_features)
        if quiet_since(mark, f"int8 activations on {qtype} rows of {in_features}"):
            kept_ways, kept_rows = _stored_width_ways(path, conds), _stored_width_rows(path, conds)  # (others' too)
            kept_ways.setdefault(qtype, {})[in_features] = ways
            kept_rows.setdefault(qtype, {})[in_features] = rows
            write(path, conds, width_ways=kept_ways, width_rows=kept_rows)
    _width_results[key] = rows
    return rows
