"""How each thread reads its rows of a GGUF weight: in `gguf.row_streams()` interleaved runs, a
count measured once per machine (model/quant/int8_trial.py's choose_row_streams) and kept in the
int8 trial's file. The count changes the order rows are read in, never a product."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.kernels import gguf as gk
from pagedllm.model.quant import int8_trial


@pytest.fixture(autouse=True)
def restore_streams():
    before = gk.row_streams()
    yield
    gk.set_row_streams(before)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_1"])
def test_every_stream_count_gives_the_same_products(qtype):
    gen = torch.Generator().manual_seed(0)
    w = gk.random_weight(qtype, 301, 512, gen)  # (301 rows: shares and runs that do not divide)
    xs = [torch.randn(rows, 512, generator=gen) for rows in (1, 3)]
    gk.set_row_streams(1)
    expected = [(gk.matmul(x, w), gk.matmul(x, w, int8=True)) for x in xs]
    for streams in range(2, gk.MAX_ROW_STREAMS + 1):
        gk.set_row_streams(streams)
        assert gk.row_streams() == streams
        for x, (floats, int8) in zip(xs, expected):
            assert torch.equal(gk.matmul(x, w), floats) and torch.equal(gk.matmul(x, w, int8=True), int8)


@pytest.mark.parametrize("streams", [0, gk.MAX_ROW_STREAMS + 1, -3])
def test_a_count_outside_the_range_is_refused_and_changes_nothing(streams):
    gk.set_row_streams(2)
    with pytest.raises(ValueError, match="row streams must be 1 to"):
        gk.set_row_streams(streams)
    assert gk.row_streams() == 2


def test_the_trial_sets_the_fastest_count_and_leaves_the_ways(monkeypatch):
    seconds = {1: 3.0, 2: 1.0, 4: 2.0, 8: 4.0}
    seen = []
    ways_before = {q: gk.int8_way(q, 1) for q in ("Q4_K", "Q6_K")}

    def fake_time(fn, repeats):
        seen.append((gk.row_streams(), gk.int8_way("Q4_K", 1) if "avx2" in gk.int8_ways("Q4_K") else None))
        return seconds[gk.row_streams()]

    monkeypatch.setattr(int8_trial, "best_wall_time", fake_time)
    monkeypatch.setattr(int8_trial, "STREAMS_TRIAL_MIB", 8)  # (the timing is faked: a small weight will do)
    assert int8_trial.choose_row_streams() == 2 and gk.row_streams() == 2
    assert {streams for streams, _ in seen} == set(int8_trial.ROW_STREAMS)
    if "avx2" in gk.int8_ways("Q4_K"):  # timed on the AVX2 way, which walks rows in streams; then put back
        assert {way for _, way in seen} == {"avx2"}
    assert {q: gk.int8_way(q, 1) for q in ways_before} == ways_before


def test_the_count_is_kept_per_machine_read_back_and_kept_beside_the_int8_trial(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(int8_trial, "others_load", lambda mark: 0.0)  # (a quiet machine, whatever this one runs)
    monkeypatch.setattr(int8_trial, "_streams_set", set())
    monkeypatch.setattr(int8_trial, "_results", {})
    timed = []

    def fake_choose():
        timed.append(1)
        gk.set_row_streams(1)
        return 1

    monkeypatch.setattr(int8_trial, "choose_row_streams", fake_choose)
    int8_trial.set_row_streams_for_machine()
    int8_trial.set_row_streams_for_machine()  # (once per process)
    path = int8_trial.trial_path(int8_trial.conditions())
    assert timed == [1, 1] and json.loads(path.read_text())["row_streams"] == 1  # (timed twice, agreeing)
    # the int8 trial writes the same file later: the count stays
    monkeypatch.setattr(int8_trial, "measure", lambda qtype: 16)
    monkeypatch.setattr(int8_trial, "choose_ways", lambda qtype: {})
    int8_trial.int8_rows_that_pay("Q4_K")
    entry = json.loads(path.read_text())
    assert entry["row_streams"] == 1 and entry["rows"] == {"Q4_K": 16}
    # a later start reads it, untimed
    gk.set_row_streams(4)
    monkeypatch.setattr(int8_trial, "_streams_set", set())
    monkeypatch.setattr(int8_trial, "choose_row_streams", lambda: pytest.fail("a kept count is not timed again"))
    int8_trial.set_row_streams_for_machine()
    assert gk.row_streams() == 1
    # a count the trial cannot give is measured again
    path.write_text(json.dumps({**entry, "row_streams": 3}))
    monkeypatch.setattr(int8_trial, "_streams_set", set())
    monkeypatch.setattr(int8_trial, "choose_row_streams", fake_choose)
    int8_trial.set_row_streams_for_machine()
    assert timed == [1] * 4 and json.loads(path.read_text())["row_streams"] == 1


def test_two_timings_that_disagree_keep_nothing_and_use_the_fewer(tmp_path, monkeypatch, caplog):
    """A trial is timed twice; a count chosen in one spell of a shared machine and not in the next
    serves the process (the fewer streams) but is not kept, and the next start times again."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(int8_trial, "others_load", lambda mark: 0.0)
    monkeypatch.setattr(int8_trial, "_streams_set", set())
    choices = iter([4, 2, 2, 2])

    def fake_choose():
        streams = next(choices)
        gk.set_row_streams(streams)
        return streams

    monkeypatch.setattr(int8_trial, "choose_row_streams", fake_choose)
    with caplog.at_level("WARNING", logger="pagedllm"):
        int8_trial.set_row_streams_for_machine()
    path = int8_trial.trial_path(int8_trial.conditions())
    assert gk.row_streams() == 2 and not path.exists() and "disagree (4, 2)" in caplog.text
    monkeypatch.setattr(int8_trial, "_streams_set", set())  # the next start: both timings agree, kept
    int8_trial.set_row_streams_for_machine()
    assert gk.row_streams() == 2 and json.loads(path.read_text())["row_streams"] == 2
