"""How each thread reads its rows of a GGUF weight: in `gguf.row_streams()` interleaved runs and
with the `gguf.prefetch()` hint, a pair measured once per machine (model/quant/read_trial.py's
choose_read_way) and kept in the int8 trial's file. Neither changes a product."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.kernels import gguf as gk
from pagedllm.model.quant import int8_trial, read_trial


@pytest.fixture(autouse=True)
def restore_read_way():
    before = gk.row_streams(), gk.prefetch()
    yield
    gk.set_row_streams(before[0])
    gk.set_prefetch(before[1])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_1"])
def test_every_stream_count_and_hint_gives_the_same_products(qtype):
    gen = torch.Generator().manual_seed(0)
    w = gk.random_weight(qtype, 301, 512, gen)  # (301 rows: shares and runs that do not divide)
    xs = [torch.randn(rows, 512, generator=gen) for rows in (1, 3)]
    gk.set_row_streams(1)
    gk.set_prefetch("nta")
    expected = [(gk.matmul(x, w), gk.matmul(x, w, int8=True)) for x in xs]
    for hint in gk.PREFETCH_HINTS:
        gk.set_prefetch(hint)
        assert gk.prefetch() == hint
        for streams in range(1, gk.MAX_ROW_STREAMS + 1):
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


@pytest.mark.parametrize("hint", ["t1", "NTA", ""])
def test_an_unknown_prefetch_hint_is_refused_and_changes_nothing(hint):
    gk.set_prefetch("t0")
    with pytest.raises(ValueError, match="prefetch hint must be one of nta, t0"):
        gk.set_prefetch(hint)
    assert gk.prefetch() == "t0"


def _fake_timings(monkeypatch, seconds):
    """best_wall_time answering seconds[(hint, streams)]; returns what each timing ran under."""
    seen = []

    def fake_time(fn, repeats):
        way = gk.int8_way("Q4_K", 1) if "avx2" in gk.int8_ways("Q4_K") else None
        seen.append((gk.prefetch(), gk.row_streams(), way))
        return seconds[gk.prefetch(), gk.row_streams()]

    monkeypatch.setattr(read_trial, "best_wall_time", fake_time)
    monkeypatch.setattr(read_trial, "STREAMS_TRIAL_MIB", 8)  # (the timing is faked: a small weight will do)
    return seen


def test_the_trial_sets_the_fastest_pair_and_leaves_the_ways(monkeypatch):
    seconds = {("nta", 1): 9.0, ("nta", 2): 8.0, ("nta", 4): 7.0, ("nta", 8): 9.5,
               ("t0", 1): 3.0, ("t0", 2): 1.0, ("t0", 4): 2.0, ("t0", 8): 4.0}
    ways_before = {q: gk.int8_way(q, 1) for q in ("Q4_K", "Q6_K")}
    seen = _fake_timings(monkeypatch, seconds)
    assert read_trial.choose_read_way() == (2, "t0") and (gk.row_streams(), gk.prefetch()) == (2, "t0")
    assert {(hint, streams) for hint, streams, _ in seen} == set(seconds)
    if "avx2" in gk.int8_ways("Q4_K"):  # timed on the AVX2 way, which walks rows in streams; then put back
        assert {way for _, _, way in seen} == {"avx2"}
    assert {q: gk.int8_way(q, 1) for q in ways_before} == ways_before


def test_t0_replaces_the_non_temporal_hint_only_past_the_margin(monkeypatch):
    """NTA's gain is in the step around the products, which the trial does not time: a T0 that
    reads a little faster (a Zen 4 EPYC's products: alike) leaves NTA, at its own best count."""
    seconds = {("nta", 1): 1.05, ("nta", 2): 1.0, ("nta", 4): 1.2, ("nta", 8): 1.3,
               ("t0", 1): 0.95, ("t0", 2): 0.96, ("t0", 4): 0.97, ("t0", 8): 0.98}
    _fake_timings(monkeypatch, seconds)
    assert read_trial.choose_read_way() == (2, "nta") and gk.prefetch() == "nta"
    seconds["t0", 8] = 1.0 / read_trial.T0_MARGIN - 0.01
    assert read_trial.choose_read_way() == (8, "t0") and gk.prefetch() == "t0"
    seconds["t0", 4] = seconds["t0", 8] * (read_trial.STREAMS_TIE - 0.01)  # (a tie: the fewer streams)
    assert read_trial.choose_read_way() == (4, "t0")


def _fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(int8_trial, "others_load", lambda mark: 0.0)  # (a quiet machine, whatever this one runs)
    monkeypatch.setattr(read_trial, "_set", set())
    monkeypatch.setattr(int8_trial, "_results", {})


def test_the_pair_is_kept_per_machine_read_back_and_kept_beside_the_int8_trial(tmp_path, monkeypatch):
    _fresh(tmp_path, monkeypatch)
    timed = []

    def fake_choose():
        timed.append(1)
        gk.set_row_streams(1)
        gk.set_prefetch("t0")
        return 1, "t0"

    monkeypatch.setattr(read_trial, "choose_read_way", fake_choose)
    read_trial.set_read_way_for_machine()
    read_trial.set_read_way_for_machine()  # (once per process)
    path = int8_trial.trial_path(int8_trial.conditions())
    entry = json.loads(path.read_text())
    assert timed == [1, 1] and (entry["row_streams"], entry["prefetch"]) == (1, "t0")  # (timed twice, agreeing)
    # the int8 trial writes the same file later: the pair stays
    monkeypatch.setattr(int8_trial, "measure", lambda qtype: 16)
    monkeypatch.setattr(int8_trial, "choose_ways", lambda qtype: {})
    int8_trial.int8_rows_that_pay("Q4_K")
    entry = json.loads(path.read_text())
    assert (entry["row_streams"], entry["prefetch"]) == (1, "t0") and entry["rows"] == {"Q4_K": 16}
    # a later start reads it, untimed
    gk.set_row_streams(4)
    gk.set_prefetch("nta")
    monkeypatch.setattr(read_trial, "_set", set())
    monkeypatch.setattr(read_trial, "choose_read_way", lambda: pytest.fail("a kept pair is not timed again"))
    read_trial.set_read_way_for_machine()
    assert (gk.row_streams(), gk.prefetch()) == (1, "t0")
    # a count or hint the trial cannot give, or an entry without the hint, is measured again
    for bad in ({"row_streams": 3}, {"prefetch": "t2"}, {"prefetch": None}):
        path.write_text(json.dumps({**entry, **bad}))
        monkeypatch.setattr(read_trial, "_set", set())
        monkeypatch.setattr(read_trial, "choose_read_way", fake_choose)
        read_trial.set_read_way_for_machine()
    assert timed == [1] * 8 and json.loads(path.read_text())["prefetch"] == "t0"


def test_two_timings_that_disagree_keep_nothing_and_use_the_fewer_streams_and_nta(tmp_path, monkeypatch, caplog):
    """A trial is timed twice; a pair chosen in one spell of a shared machine and not in the next
    serves the process (the fewer streams, the non-temporal hint if either chose it) but is not
    kept, and the next start times again."""
    _fresh(tmp_path, monkeypatch)
    choices = iter([(4, "t0"), (2, "nta"), (2, "t0"), (2, "t0")])

    def fake_choose():
        streams, hint = next(choices)
        gk.set_row_streams(streams)
        gk.set_prefetch(hint)
        return streams, hint

    monkeypatch.setattr(read_trial, "choose_read_way", fake_choose)
    with caplog.at_level("WARNING", logger="pagedllm"):
        read_trial.set_read_way_for_machine()
    path = int8_trial.trial_path(int8_trial.conditions())
    assert (gk.row_streams(), gk.prefetch()) == (2, "nta") and not path.exists()
    assert "disagree (4 t0, 2 nta)" in caplog.text
    monkeypatch.setattr(read_trial, "_set", set())  # the next start: both timings agree, kept
    read_trial.set_read_way_for_machine()
    entry = json.loads(path.read_text())
    assert (gk.row_streams(), gk.prefetch()) == (2, "t0") and (entry["row_streams"], entry["prefetch"]) == (2, "t0")
