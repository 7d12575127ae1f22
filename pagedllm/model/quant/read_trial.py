"""How each thread reads a GGUF weight's rows: in how many interleaved runs, and with which
software prefetch hint, measured once per machine and kept beside the int8 trial.

Both are properties of the core, not of the model, and neither changes a product, only how fast
its rows arrive: how many streams a core's prefetchers follow best (a Xeon VM: four, one left
DRAM's latency exposed; a Zen 4 EPYC: one or two), and whether the weight stream's prefetch may
be non-temporal (PREFETCHNTA keeps a weight's lines out of the caches the step keeps using: on a
Zen 4 EPYC the default model's step 7.5 -> 6.8 ms, the products' rates unchanged; on a 2-core
Xeon VM with AMX it throttled the stream to a third: a 1-row Q8_0 product of 178 MB 11.4 GB/s
against 30.7 with PREFETCHT0). `choose_read_way` times one-row products past the caches at each
pair; `set_read_way_for_machine` sets the kept pair, else times it twice and keeps it where the
two agree and the machine was quiet (int8_trial's file, keys "row_streams" and "prefetch").
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from pagedllm.kernels import gguf as gguf_kernels
from pagedllm.model.quant import int8_trial
from pagedllm.utils import best_wall_time, load_mark

logger = logging.getLogger("pagedllm")

# One-row products of Q4_K and Q6_K (Q4_K_M's types) on weights of this many MiB in all, past a
# server CPU's L3 as a model's weights are (a weight in the caches reads alike in any order), at
# each count of interleaved runs a thread may read in, with each prefetch hint.
STREAMS_TRIAL_MIB = 128
ROW_STREAMS = (1, 2, 4, 8)
PREFETCH_HINTS = gguf_kernels.PREFETCH_HINTS
# How much faster PREFETCHT0 must read to replace the non-temporal hint: NTA's gain is in the
# step around the products (what stays in the caches), which one-row products alone do not show.
T0_MARGIN = 1.1
# Counts within this factor of the fastest are a tie, which the fewer wins (a Xeon VM, T0: 4 and 8
# streams 26.2 and 26.8 GB/s in one timing, 24.6 and 24.4 in the next: two timings that would
# disagree, and nothing kept, at every start).
STREAMS_TIE = 1.03


def _past_the_caches(qtype: str, out_features: int, in_features: int, gen: torch.Generator):
    """A random `qtype` weight of about STREAMS_TRIAL_MIB / 2: one of out_features x in_features,
    repeated (every copy at its own address, so read from memory as a model's weights are)."""
    tile = gguf_kernels.random_weight(qtype, out_features, in_features, gen)
    copies = max(1, (STREAMS_TRIAL_MIB << 19) // tile.nbytes)
    return gguf_kernels.from_data(qtype, out_features * copies, in_features, tile.data.repeat(copies, 1))


def choose_read_way() -> tuple[int, str]:
    """Time one-row products on weights past the caches at each pair of row streams (1, 2, 4, 8
    interleaved runs a thread, `gguf.set_row_streams`) and prefetch hint (`gguf.set_prefetch`),
    and set the fastest; returns (streams, hint). "t0" only where it reads T0_MARGIN faster than
    "nta" at its best count; the fewest streams within STREAMS_TIE of that hint's fastest. A Q4_K
    weight `int8_trial.TRIAL_SHAPE` and a Q6_K one of its transpose's shape (the count matters
    most for Q6_K: on a Zen 4 EPYC its 1-row product read 26.5 GB/s in one stream, 18.4 in four,
    Q4_K's 28.6 and 27.1), each pair timed in turn, the best of 5 rounds. On int8 activations by
    the AVX2 way (the one-row way that walks rows so), on float32's where the path has no int8."""
    gen = torch.Generator().manual_seed(3)
    shape = int8_trial.TRIAL_SHAPE
    weights = [_past_the_caches("Q4_K", *shape, gen), _past_the_caches("Q6_K", *shape[::-1], gen)]
    xs = [torch.randn(1, w.in_features, generator=gen) for w in weights]
    int8 = "avx2" in gguf_kernels.int8_ways("Q4_K")
    before = {q: gguf_kernels.int8_way(q, 1) for q in ("Q4_K", "Q6_K")} if int8 else {}
    for qtype in before:
        gguf_kernels.set_int8_way(qtype, 1, "avx2")

    def products():
        for x, w in zip(xs, weights):
            gguf_kernels.matmul(x, w, int8=int8)

    times = {(hint, streams): float("inf") for hint in PREFETCH_HINTS for streams in ROW_STREAMS}
    for _ in range(5):  # (rounds over the pairs: a slower spell of the machine falls on each alike)
        for hint, streams in times:
            gguf_kernels.set_prefetch(hint)
            gguf_kernels.set_row_streams(streams)
            times[hint, streams] = min(times[hint, streams], best_wall_time(products, 1))
    for qtype, way in before.items():
        gguf_kernels.set_int8_way(qtype, 1, way)
    best = {hint: min(t for (h, _), t in times.items() if h == hint) for hint in PREFETCH_HINTS}
    hint = "t0" if best["t0"] * T0_MARGIN < best["nta"] else "nta"
    fastest = min(times[hint, n] for n in ROW_STREAMS)
    streams = min(n for n in ROW_STREAMS if times[hint, n] <= fastest * STREAMS_TIE)
    gguf_kernels.set_prefetch(hint)
    gguf_kernels.set_row_streams(streams)
    nbytes = sum(w.nbytes for w in weights)
    logger.info("Weight rows read in %d interleaved run%s per thread, prefetched %s (timed, GB/s: %s)", streams,
                "" if streams == 1 else "s", hint.upper(),
                ", ".join(f"{h} {n}: {nbytes / t / 1e9:.1f}" for (h, n), t in times.items()))
    return streams, hint


def _stored(path: Path, conds: dict) -> tuple[int, str] | None:
    """The read way kept at `path` for these conditions (`choose_read_way`), None without."""
    entry = int8_trial.entry(path, conds)
    streams, hint = entry.get("row_streams"), entry.get("prefetch")
    ok = type(streams) is int and streams in ROW_STREAMS and hint in PREFETCH_HINTS
    return (streams, hint) if ok else None


_set: set[str] = set()  # per process: the conditions' files whose read way is set


def set_read_way_for_machine() -> None:
    """Set the row streams and prefetch hint measured for this machine (`choose_read_way`): kept
    in the int8 trial's file, else timed now (about a second) and kept."""
    conds = int8_trial.conditions()
    path = int8_trial.trial_path(conds)
    if str(path) in _set:
        return
    kept = _stored(path, conds)
    if kept is not None:
        gguf_kernels.set_row_streams(kept[0])
        gguf_kernels.set_prefetch(kept[1])
    else:
        mark = load_mark()
        way, again = choose_read_way(), choose_read_way()
        if again != way:  # a spell of the machine decided it: not kept, timed at the next start
            # (on a Zen 5 VM one trial kept four streams where quiet ones gave two: a step of
            # Gemma-3-1B's shape 44.8 against 25.8 ms until the kernels changed)
            hint = "nta" if "nta" in (way[1], again[1]) else "t0"
            logger.warning("Two timings of the weight rows' reading disagree (%d %s, %d %s): the fewer streams and "
                           "%s serve this process and nothing is kept (timed again at the next start)",
                           *way, *again, hint)
            gguf_kernels.set_row_streams(min(way[0], again[0]))
            gguf_kernels.set_prefetch(hint)
        elif int8_trial.quiet_since(mark, "the weight rows' reading"):
            int8_trial.write(path, conds, others={"row_streams": way[0], "prefetch": way[1]})
    _set.add(str(path))
