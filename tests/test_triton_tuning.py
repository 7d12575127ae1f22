"""The Triton attention kernel's tuning table: its file format and errors, the nearest-bucket
lookup, that the backend launches what the table (or a forced launch) says, that every launch
shape the sweep may choose computes the same attention, and the sweep script end to end on the
interpreter's tiny shapes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from pagedllm.attention import triton_tuning  # noqa: E402
from pagedllm.attention.triton_backend import MAX_PARTITIONS, TritonAttentionBackend  # noqa: E402
from pagedllm.attention.triton_tuning import LaunchConfig, TuningEntry, TuningTable, parse_table  # noqa: E402
from tests.test_triton_attention import _batch, _check  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _entry(kind="decode", context=1024, batch=64, **config):
    return TuningEntry(kind, 64, 4, context, batch, LaunchConfig(**config))


def test_lookup_takes_the_nearest_bucket_of_the_same_kind_head_size_and_group():
    table = TuningTable([
        _entry(context=256, batch=1, tile_n=16),
        _entry(context=1024, batch=64, tile_n=32),
        _entry(context=4096, batch=64, tile_n=128),
        _entry("prompt", context=1024, batch=512, tile_n=64, num_warps=8),
    ])
    assert table.lookup("decode", 64, 4, 1024, 64).tile_n == 32  # exact
    assert table.lookup("decode", 64, 4, 900, 50).tile_n == 32  # nearest on a log scale
    assert table.lookup("decode", 64, 4, 200, 2).tile_n == 16
    assert table.lookup("decode", 64, 4, 10_000, 100).tile_n == 128  # past the largest bucket
    assert table.lookup("prompt", 64, 4, 64, 3).num_warps == 8  # the only prompt entry
    assert table.lookup("decode", 128, 4, 1024, 64) is None  # no entry of this head size
    assert table.lookup("decode", 64, 3, 1024, 64) is None  # nor of this group


def test_a_table_roundtrips_through_its_json_form(tmp_path, monkeypatch):
    table = TuningTable([_entry(tile_n=32, num_warps=2, num_stages=3, num_partitions=8)], device="NVIDIA H200")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table.to_json("3.x")))
    monkeypatch.setenv(triton_tuning.ENV_VAR, str(path))
    loaded = triton_tuning.load_table("any", MAX_PARTITIONS)
    assert loaded.entries == table.entries and loaded.device == "NVIDIA H200"


def test_without_a_table_for_the_device_nothing_is_loaded(monkeypatch):
    monkeypatch.delenv(triton_tuning.ENV_VAR, raising=False)
    assert triton_tuning.load_table("Some GPU That Has No Table", MAX_PARTITIONS) is None
    assert triton_tuning.device_file("NVIDIA H200").name == "nvidia-h200.json"


def test_the_committed_h200_table_loads_and_is_chosen_for_that_gpu(monkeypatch):
    """The sweep's table from an H200 run ships in the package: an H200 finds it by its name, and
    a decode step of the default model's attention (head size 64, group 3) gets its bucket's
    measured launch shape."""
    monkeypatch.delenv(triton_tuning.ENV_VAR, raising=False)
    table = triton_tuning.load_table("NVIDIA H200", MAX_PARTITIONS)
    assert table is not None and table.source.endswith("nvidia-h200.json")
    kinds = {(e.kind, e.group) for e in table.entries}
    assert {("decode", 3), ("decode", 4), ("prompt", 3), ("prompt", 4)} <= kinds
    launch = table.lookup("decode", 64, 3, 1024, 64)
    expected = next(e.config for e in table.entries if (e.kind, e.group, e.context, e.batch) == ("decode", 3, 1024, 64))
    assert launch == expected


@pytest.mark.parametrize("change, message", [
    ({"kind": "both"}, "kind must be one of"),
    ({"context": 0}, "context must be a positive integer"),
    ({"config": {"tile_n": 24}}, "tile_n must be a power of two"),
    ({"config": {"num_warps": 3}}, "num_warps must be one of"),
    ({"config": {"num_stages": 0}}, "num_stages must be an integer"),
    ({"config": {"num_partitions": 64}}, "num_partitions must be null or a power of two"),
    ({"config": {"block": 2}}, "config must be an object of"),
])
def test_a_malformed_entry_is_refused_naming_the_file_and_field(change, message):
    raw = {"kind": "decode", "head_dim": 64, "group": 4, "context": 1024, "batch": 64, "config": {}}
    raw.update(change)
    with pytest.raises(ValueError, match=message) as info:
        parse_table({"entries": [raw]}, "tuning.json", MAX_PARTITIONS)
    assert "tuning.json: entries[0]" in str(info.value)


def test_a_missing_or_broken_file_named_by_the_variable_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(triton_tuning.ENV_VAR, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="names no file"):
        triton_tuning.load_table("x", MAX_PARTITIONS)
    (tmp_path / "bad.json").write_text("{")
    monkeypatch.setenv(triton_tuning.ENV_VAR, str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="not JSON"):
        triton_tuning.load_table("x", MAX_PARTITIONS)


def test_the_backend_launches_the_tables_shape_for_its_step(triton_device):
    decode = _entry(context=256, batch=4, tile_n=16, num_warps=2, num_stages=3, num_partitions=2)
    prompt = TuningEntry("prompt", 32, 3, 256, 64, LaunchConfig(tile_n=128, num_warps=8, num_stages=1))
    decode = TuningEntry("decode", 32, 3, decode.context, decode.batch, decode.config)
    backend = TritonAttentionBackend(triton_device, tuning=TuningTable([decode, prompt]))
    query = torch.zeros(4, 6, 32, device=triton_device)
    cache = torch.zeros(backend.kv_cache_shape(160, 16, 2, 32), device=triton_device)
    metadata, _ = _batch([1, 1, 1, 1], [10, 100, 200, 250], 16, triton_device)
    backend.forward(query, None, None, cache, cache, metadata, 0.1)
    plan = metadata.backend_plan
    assert (plan.tile_n, plan.num_warps, plan.num_stages, plan.num_partitions) == (16, 2, 3, 2)
    metadata, _ = _batch([1, 30], [40, 200], 16, triton_device)
    backend.forward(torch.zeros(31, 6, 32, device=triton_device), None, None, cache, cache, metadata, 0.1)
    plan = metadata.backend_plan
    assert (plan.tile_n, plan.num_warps, plan.num_stages) == (128, 8, 1)


def test_a_forced_launch_wins_over_the_table_and_a_forced_split_over_both(triton_device):
    table = TuningTable([TuningEntry("decode", 32, 3, 256, 4, LaunchConfig(tile_n=16, num_partitions=2))])
    forced = LaunchConfig(tile_n=32, num_warps=4, num_stages=2, num_partitions=4)
    backend = TritonAttentionBackend(triton_device, num_partitions=1, launch=forced, tuning=table)
    assert backend.launch_for(True, 32, 3, 256, 4) == forced
    metadata, _ = _batch([1, 1], [100, 250], 16, triton_device)
    cache = torch.zeros(backend.kv_cache_shape(160, 16, 2, 32), device=triton_device)
    backend.forward(torch.zeros(2, 6, 32, device=triton_device), None, None, cache, cache, metadata, 0.1)
    assert (metadata.backend_plan.tile_n, metadata.backend_plan.num_partitions) == (32, 1)
    with pytest.raises(ValueError, match="launch: tile_n"):
        TritonAttentionBackend(triton_device, launch=LaunchConfig(tile_n=8))


@pytest.mark.parametrize("launch", [
    LaunchConfig(tile_n=16, num_warps=2, num_stages=1, num_partitions=1),
    LaunchConfig(tile_n=32, num_warps=8, num_stages=4, num_partitions=4),
    LaunchConfig(tile_n=128, num_warps=4, num_stages=2, num_partitions=2),
], ids=["t16-p1", "t32-p4", "t128-p2"])
def test_every_launch_shape_computes_the_reference_attention(triton_device, launch, monkeypatch):
    """The shapes a sweep may choose give the reference backend's output: decodes and a mixed
    step, with contexts that a tile or partition splits unevenly."""
    original = TritonAttentionBackend.__init__

    def with_launch(self, device, num_partitions=None, **kwargs):
        original(self, device, num_partitions, launch=launch)

    monkeypatch.setattr(TritonAttentionBackend, "__init__", with_launch)
    _check([1, 1, 1], [3, 90, 250], block_size=16, group=3, device=triton_device)
    _check([1, 5, 17], [64, 5, 150], block_size=16, group=3, device=triton_device)


def test_the_sweep_writes_a_table_of_the_fastest_correct_candidate(tmp_path):
    """benchmarks/gpu_autotune.py on the interpreter's tiny shapes: every bucket gets the
    candidate with the least measured time among those that computed the default's output, and
    the table it writes is one the backend loads."""
    out = tmp_path / "tuning.json"
    records = tmp_path / "records.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_autotune.py"), "--device", "cpu", "--quick",
         "--output", str(out), "--records", str(records)],
        check=True, cwd=ROOT, timeout=600, capture_output=True,
    )
    table = parse_table(json.loads(out.read_text()), str(out), MAX_PARTITIONS)
    rows = json.loads(records.read_text())
    assert len(table) >= 1
    for entry in table.entries:
        bucket = [r for r in rows if (r["kind"], r["head_dim"], r["group"], r["context"], r["batch"])
                  == (entry.kind, entry.head_dim, entry.group, entry.context, entry.batch)]
        ok = [r for r in bucket if r["ok"]]
        assert len(bucket) >= 2 and ok
        assert LaunchConfig(**min(ok, key=lambda r: r["us"])["config"]) == entry.config
