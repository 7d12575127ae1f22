"""int8 activations per row width: at a width narrower than the start-up trial's (2048), the
int8 ways are timed again and against float32 activations, and a weight of that width takes the
faster way and int8 only up to the rows where it still wins there (model/quant/int8_trial.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pagedllm.model.quant import EVERY_SIZE, int8_trial
from tests.test_int8_default import trial_cache  # noqa: F401 (a fixture: a fresh trial file)

def test_a_widths_way_serves_products_of_that_width_only():
    """The C side: a way set for Q8_0 rows 640 wide serves those products (bitwise the product
    with that way set for the type) and nothing else; None gives the bucket back to the type's."""
    import torch

    from pagedllm.kernels import gguf

    ways = gguf.int8_ways("Q8_0")
    if len(ways) < 2:
        pytest.skip("one int8 way on this path: nothing to choose")
    rows, (first, second) = 4, ways[:2]
    gen = torch.Generator().manual_seed(0)
    narrow, wide = gguf.random_weight("Q8_0", 96, 640, gen), gguf.random_weight("Q8_0", 96, 1024, gen)
    x640, x1024 = torch.randn(rows, 640, generator=gen), torch.randn(rows, 1024, generator=gen)
    before = gguf.int8_way("Q8_0", rows)
    try:
        gguf.set_int8_way("Q8_0", rows, second)
        by_second = gguf.matmul(x640, narrow, int8=True)
        gguf.set_int8_way("Q8_0", rows, first)
        by_first_wide = gguf.matmul(x1024, wide, int8=True)
        gguf.set_int8_way("Q8_0", rows, second, in_features=640)
        assert gguf.int8_way("Q8_0", rows, in_features=640) == second
        assert gguf.int8_way("Q8_0", rows) == first and gguf.int8_way("Q8_0", rows, in_features=1024) == first
        assert gguf.int8_way("Q8_0", 1, in_features=640) == gguf.int8_way("Q8_0", 1)  # other buckets: the type's
        assert torch.equal(gguf.matmul(x640, narrow, int8=True), by_second)
        assert torch.equal(gguf.matmul(x1024, wide, int8=True), by_first_wide)
        gguf.set_int8_way("Q8_0", rows, None, in_features=640)
        assert gguf.int8_way("Q8_0", rows, in_features=640) == first
    finally:
        gguf.set_int8_way("Q8_0", rows, None, in_features=640)
        gguf.set_int8_way("Q8_0", rows, before)


@pytest.fixture
def width_ways(monkeypatch):
    """Two int8 ways whose per-width setting is recorded instead of reaching the C side; the
    faked timings make "avx2" win at 1 and 2 rows, "vnni" above; `timed` lists (width, rows, way)."""
    state = SimpleNamespace(set={}, timed=[])
    monkeypatch.setattr(int8_trial.gguf_kernels, "int8_ways", lambda qtype=None: ["vnni", "avx2"])
    monkeypatch.setattr(int8_trial.gguf_kernels, "set_int8_way",
                        lambda qtype, rows, way, in_features=None: state.set.__setitem__((qtype, in_features, rows), way))
    monkeypatch.setattr(int8_trial.gguf_kernels, "random_weight",
                        lambda qtype, out, inn, gen=None: SimpleNamespace(in_features=inn, out_features=out))

    state.float_time = lambda rows: 3.0  # (float32 activations never win unless a test says so)

    def matmul(x, w, int8=False):
        way = state.set[("Q8_0", w.in_features, x.shape[0])] if int8 else "float32"
        state.timed.append((w.in_features, x.shape[0], way))

    def fake_time(fn, repeats):
        fn()
        _, rows, way = state.timed[-1]
        if way == "float32":
            return state.float_time(rows)
        return 1.0 if (way == "avx2") == (rows <= 2) else 2.0

    monkeypatch.setattr(int8_trial.gguf_kernels, "matmul", matmul)
    monkeypatch.setattr(int8_trial, "best_wall_time", fake_time)
    return state


def test_narrower_widths_take_the_ways_their_own_timings_find_faster(trial_cache, width_ways, monkeypatch):
    """A width narrower than the trial's is timed at the decode buckets on a weight of the trial's
    bytes and its winners set for that width; kept, and set again without timing on the next start;
    the trial's width and wider ones are not timed (its ways hold)."""
    int8_trial.set_ways_for_width("Q8_0", 640)
    decode = [b for b in int8_trial.gguf_kernels.INT8_WAY_BUCKETS if b <= int8_trial.gguf_kernels.MAX_ROWS]
    expected = {rows: "avx2" if rows <= 2 else "vnni" for rows in decode}
    assert {rows: width_ways.set["Q8_0", 640, rows] for rows in decode} == expected
    assert {w for w, _, _ in width_ways.timed} == {640}
    kept = json.loads(trial_cache.path.read_text())["width_ways"]
    assert kept == {"Q8_0": {"640": {str(rows): way for rows, way in expected.items()}}}
    assert json.loads(trial_cache.path.read_text())["width_rows"] == {"Q8_0": {"640": EVERY_SIZE}}
    count = len(width_ways.timed)
    int8_trial.set_ways_for_width("Q8_0", int8_trial.TRIAL_SHAPE[1])
    int8_trial.set_ways_for_width("Q8_0", 8192)
    assert len(width_ways.timed) == count  # the trial's width and wider: not timed
    monkeypatch.setattr(int8_trial, "_width_results", {})  # a second start on this machine
    width_ways.set.clear()
    int8_trial.set_ways_for_width("Q8_0", 640)
    assert len(width_ways.timed) == count  # read, not timed
    assert {rows: width_ways.set["Q8_0", 640, rows] for rows in decode} == expected
    # The type's own trial, kept later, keeps the width's ways beside it.
    assert int8_trial.int8_rows_that_pay("Q4_K") == 16
    assert json.loads(trial_cache.path.read_text())["width_ways"] == kept


def test_a_width_where_float32_wins_bounds_its_int8_rows(trial_cache, width_ways, monkeypatch):
    """Where float32 activations beat the best int8 way at a width from some bucket on, int8
    pays up to the row count before that bucket at this width: returned, kept, read back on the
    next start without timing, and "auto" gives each weight of that width the lesser of its
    type's bound and its width's ("on" keeps every size)."""
    width_ways.float_time = lambda rows: 0.5 if rows >= 4 else 1.5  # (int8's best way: 1.0 at every size)
    assert int8_trial.set_ways_for_width("Q8_0", 640) == 3
    assert json.loads(trial_cache.path.read_text())["width_rows"] == {"Q8_0": {"640": 3}}
    float_timed = [rows for _, rows, way in width_ways.timed if way == "float32"]
    assert float_timed == [1, 2, 4]  # (past the first loss only the ways are timed)
    count = len(width_ways.timed)
    monkeypatch.setattr(int8_trial, "_width_results", {})  # a second start on this machine
    assert int8_trial.set_ways_for_width("Q8_0", 640) == 3
    assert len(width_ways.timed) == count  # read, not timed

    from pagedllm.model import layers

    methods = [SimpleNamespace(qtypes=["Q8_0"], in_features=640, int8_rows=0),
               SimpleNamespace(qtypes=["Q8_0"], in_features=2048, int8_rows=0)]
    monkeypatch.setattr(layers, "_int8_methods", lambda model: methods)
    monkeypatch.setattr(layers, "set_read_way_for_machine", lambda: None)
    monkeypatch.setattr(layers, "int8_rows_that_pay", lambda qtype: 16)
    layers.use_int8_activations(None, "auto")
    assert [m.int8_rows for m in methods] == [3, 16]
    layers.use_int8_activations(None, "on")
    assert [m.int8_rows for m in methods] == [layers.gguf_kernels.MAX_ROWS] * 2
