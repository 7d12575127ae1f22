"""Int8 activations by default for GGUF-quantized models on a CPU: how the default resolves
(auto for quantized blocks, off for float models and in batch-invariant mode), and the trial that
decides where int8 pays, measured once per machine and kept in the cache folder."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs, SchedulerConfig
from pagedllm.model import layers
from pagedllm.model.quant import int8_trial, read_trial
from pagedllm.model.quant import EVERY_SIZE, GGUFLinear

# Q4_K projections, and Q4_1 ones (ffn_down): two types, two trials.
TYPES = {"default": "Q4_K", "ffn_down": "Q4_1"}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A 2-layer Llama GGUF of random Q4_K and Q4_1 blocks with the default model's tokenizer."""
    from pagedllm.transformers_utils import resolve_model
    from tests.gguf_writer import tokenizer_fields, write_random_llama

    path = tmp_path_factory.mktemp("int8-default") / "tiny-q4_k.gguf"
    return write_random_llama(path, TYPES, hidden=256, intermediate=512, vocab=49152,
                              tokenizer=tokenizer_fields(resolve_model(None).path))


def _quantized_methods(llm) -> list[GGUFLinear]:
    return layers._int8_methods(llm.llm_engine.executor.worker.model)


def _fixed_trial(qtype: str) -> int:
    """A trial's result without timing, one per type: int8 up to 16 rows for Q4_K, 4 for Q4_1."""
    return {"Q4_K": 16, "Q4_1": 4}[qtype]


# --- what the default resolves to ----------------------------------------------------------------


def test_not_choosing_is_none_in_the_config_and_on_the_command_line():
    from pagedllm.cli import build_parser
    from pagedllm.entrypoints.cli_args import engine_args_from

    assert EngineArgs().create_engine_config().model.int8_activations is None
    parse = lambda *flags: engine_args_from(build_parser().parse_args(["generate", "hi", *flags]))  # noqa: E731
    assert parse().int8_activations is None
    assert parse("--int8-activations", "off").int8_activations == "off"
    with pytest.raises(SystemExit):  # the flag's choices stay off, auto and on
        parse("--int8-activations", "default")


def test_the_default_is_auto_where_quantized_blocks_are_served_else_off(monkeypatch):
    quantized = [SimpleNamespace(quant_method=GGUFLinear(parts=[SimpleNamespace(qtype="Q4_K")]))]
    monkeypatch.setattr(layers, "_linear_layers", lambda model: quantized)
    assert layers.resolve_int8_activations(None, None) == "auto"
    assert layers.resolve_int8_activations(None, None, batch_invariant=True) == "off"
    for mode in ("off", "auto", "on"):  # a choice stands
        assert layers.resolve_int8_activations(None, mode) == mode
    monkeypatch.setattr(layers, "_linear_layers", lambda model: [])  # float weights only
    assert layers.resolve_int8_activations(None, None) == "off"


def test_a_gguf_model_defaults_to_int8_where_the_trial_says_it_pays(tiny_gguf, monkeypatch, caplog):
    monkeypatch.setattr(layers, "int8_rows_that_pay", _fixed_trial)
    width_rows = {256: 3, 512: EVERY_SIZE}  # (a width's own trial: float32 wins from 4 rows at 256)
    monkeypatch.setattr(layers, "set_ways_for_width", lambda qtype, in_features: width_rows[in_features])
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(str(tiny_gguf), max_model_len=128, num_gpu_blocks=64)
    try:
        assert llm.llm_engine.executor.worker.int8_activations == "auto"
        methods = _quantized_methods(llm)
        assert {q for m in methods for q in m.qtypes} == {"Q4_K", "Q4_1"}
        for method in methods:  # the trial's rows, each weight by its kernels, bounded by its width's
            assert method.int8_rows == min(*(_fixed_trial(q) for q in method.qtypes), width_rows[method.in_features])
        assert {m.in_features for m in methods} == {256, 512}
        assert "int8 activations: auto (the default" in caplog.text  # the start-up log says so
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.llm_engine.shutdown()


def test_off_keeps_every_product_on_float32_activations(tiny_gguf, monkeypatch, caplog):
    monkeypatch.setattr(layers, "int8_rows_that_pay", lambda qtype: pytest.fail("off needs no trial"))
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(str(tiny_gguf), max_model_len=128, num_gpu_blocks=64, int8_activations="off")
    try:
        assert llm.llm_engine.executor.worker.int8_activations == "off"
        assert all(m.int8_rows == 0 for m in _quantized_methods(llm))
        assert "int8 activations: off (chosen)" in caplog.text
    finally:
        llm.llm_engine.shutdown()


def test_a_float_model_defaults_to_off_without_a_warning(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(str(tiny_llama), max_model_len=128, num_gpu_blocks=32)
    try:
        assert llm.llm_engine.executor.worker.int8_activations == "off"
        assert not _quantized_methods(llm)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "int8" in r.getMessage()]
    finally:
        llm.llm_engine.shutdown()


def test_batch_invariant_mode_defaults_to_off_and_refuses_a_chosen_int8(tiny_gguf, monkeypatch):
    monkeypatch.setattr(layers, "int8_rows_that_pay", lambda qtype: pytest.fail("batch-invariant mode needs no trial"))
    llm = LLM(str(tiny_gguf), max_model_len=128, num_gpu_blocks=64, batch_invariant=True)
    try:
        assert llm.llm_engine.executor.worker.int8_activations == "off"
        assert not _quantized_methods(llm)  # every product float32, at a fixed tile
    finally:
        llm.llm_engine.shutdown()
    for mode in ("auto", "on"):
        with pytest.raises(ValueError, match=rf"int8_activations='{mode}' \(--int8-activations {mode}\) and "
                                             "batch_invariant do not combine"):
            EngineArgs(int8_activations=mode, batch_invariant=True).create_engine_config()
    EngineArgs(int8_activations="off", batch_invariant=True).create_engine_config()  # off is what the mode does


# --- the trial --------------------------------------------------------------------------------------


def test_the_trial_covers_decode_batches_and_a_prompt_chunk_of_the_default_budget():
    assert int8_trial.TRIAL_ROWS == tuple(sorted(int8_trial.TRIAL_ROWS)) and int8_trial.TRIAL_ROWS[0] == 1
    assert SchedulerConfig().max_num_seqs in int8_trial.TRIAL_ROWS
    assert int8_trial.TRIAL_ROWS[-1] >= SchedulerConfig().max_num_batched_tokens


@pytest.mark.parametrize("wins_up_to, expected", [(0, 0), (16, 16), (256, 256), (10**9, EVERY_SIZE)])
def test_the_trial_takes_int8_up_to_its_last_win_and_every_size_past_the_largest(monkeypatch, wins_up_to, expected):
    """Timings faked per (rows, int8): int8 is taken up to the largest row count where it won
    along with every smaller one, no larger product is timed, and winning at the largest trial
    size (a prompt chunk) means every size."""
    timed = []
    monkeypatch.setattr(int8_trial.gguf_kernels, "matmul", lambda x, w, int8=False: timed.append((x.shape[0], int8)))

    def fake_time(fn, repeats):
        fn()
        rows, int8 = timed[-1]
        return (1.0 if rows <= wins_up_to else 3.0) if int8 else 2.0

    monkeypatch.setattr(int8_trial, "best_wall_time", fake_time)
    assert int8_trial.measure("Q4_K") == expected
    first_loss = next((r for r in int8_trial.TRIAL_ROWS if r > wins_up_to), int8_trial.TRIAL_ROWS[-1])
    assert max(rows for rows, _ in timed) == first_loss


def test_a_loss_ends_the_trial_only_when_timed_twice(monkeypatch):
    """A result is kept for good: a size where int8 loses is timed again, and a win there (one
    slow spell of the machine) goes on to the next size; a loss seen twice ends the trial."""
    timed = []
    monkeypatch.setattr(int8_trial.gguf_kernels, "matmul", lambda x, w, int8=False: timed.append((x.shape[0], int8)))
    pairs_at: dict[int, int] = {}

    def fake_time(fn, repeats):
        fn()
        rows, int8 = timed[-1]
        if not int8:
            return 2.0
        pairs_at[rows] = pairs_at.get(rows, 0) + 1
        first_at_4 = rows == 4 and pairs_at[rows] == 1
        return 3.0 if rows >= 8 or first_at_4 else 1.0  # (4 rows: a loss, then a win)

    monkeypatch.setattr(int8_trial, "best_wall_time", fake_time)
    assert int8_trial.measure("Q4_K") == 4
    assert pairs_at == {1: 1, 4: 2, 8: 2}


@pytest.fixture
def trial_cache(tmp_path, monkeypatch):
    """A fresh cache folder and process memory, on a quiet machine (whatever else this one runs);
    `measured` counts the trials that ran."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(int8_trial, "others_load", lambda mark: 0.0)
    monkeypatch.setattr(int8_trial, "_results", {})
    measured: list[str] = []
    monkeypatch.setattr(int8_trial, "measure", lambda qtype: measured.append(qtype) or _fixed_trial(qtype))
    monkeypatch.setattr(int8_trial, "choose_ways", lambda qtype: {})  # (tests/ways below fake a choice)
    return SimpleNamespace(path=int8_trial.trial_path(int8_trial.conditions()), measured=measured)


def _new_process(monkeypatch) -> None:
    monkeypatch.setattr(int8_trial, "_results", {})


def test_the_trial_is_kept_per_machine_and_reused_without_timing(trial_cache, monkeypatch, caplog):
    assert int8_trial.int8_rows_that_pay("Q4_K") == 16 and int8_trial.int8_rows_that_pay("Q4_1") == 4
    assert trial_cache.measured == ["Q4_K", "Q4_1"]
    entry = json.loads(trial_cache.path.read_text())
    assert entry["rows"] == {"Q4_K": 16, "Q4_1": 4} and entry["conditions"] == int8_trial.conditions()
    assert {"cpu", "flags", "kernels", "gguf_isa", "threads"} <= set(entry["conditions"])
    assert entry["conditions"]["kernels"].startswith("pagedllm_kernels-")  # the library's own name
    _new_process(monkeypatch)  # a second start on this machine: read, not timed
    monkeypatch.setattr(int8_trial, "measure", lambda qtype: pytest.fail("a kept trial is not timed again"))
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert int8_trial.int8_rows_that_pay("Q4_K") == 16 and int8_trial.int8_rows_that_pay("Q4_1") == 4
    assert "measured on this CPU and kernel library before" in caplog.text


def test_a_trial_on_a_busy_machine_serves_its_process_and_is_not_kept(trial_cache, monkeypatch, caplog):
    """Other processes past BUSY_CORES while it was timed: the rows (and ways, and read way)
    are used, and the next start times them again."""
    monkeypatch.setattr(int8_trial, "others_load", lambda mark: 1.2)
    monkeypatch.setattr(read_trial, "_set", set())
    way = (int8_trial.gguf_kernels.row_streams(), int8_trial.gguf_kernels.prefetch())
    monkeypatch.setattr(read_trial, "choose_read_way", lambda: way)
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        assert int8_trial.int8_rows_that_pay("Q4_K") == 16
        read_trial.set_read_way_for_machine()
    assert "kept 1.2 cores busy" in caplog.text and not trial_cache.path.exists()
    _new_process(monkeypatch)
    monkeypatch.setattr(int8_trial, "others_load", lambda mark: 0.1)  # quiet now: timed again, and kept
    assert int8_trial.int8_rows_that_pay("Q4_K") == 16
    assert trial_cache.measured == ["Q4_K", "Q4_K"] and json.loads(trial_cache.path.read_text())["rows"] == {"Q4_K": 16}


def test_other_processes_load_is_read_from_the_machines_counters():
    """A busy loop in another process shows as about a core; this process's own work does not."""
    import subprocess
    import sys
    import time

    from pagedllm.utils import load_mark, others_load

    mark = load_mark()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:  # our own work
        pass
    own_only = others_load(mark)
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.monotonic() + 0.6\nwhile time.monotonic() < end: pass"])
    mark = load_mark()
    child.wait()
    assert others_load(mark) - own_only > 0.5  # (whatever else the machine runs counts in both)
    assert others_load(None) == 0.0


def test_other_conditions_are_measured_anew(trial_cache, monkeypatch):
    int8_trial.int8_rows_that_pay("Q4_K")
    conditions = int8_trial.conditions
    monkeypatch.setattr(int8_trial, "conditions", lambda: {**conditions(), "kernels": "pagedllm_kernels-other.so"})
    int8_trial.int8_rows_that_pay("Q4_K")  # another kernel library: another entry
    assert trial_cache.measured == ["Q4_K", "Q4_K"]
    assert len(list(trial_cache.path.parent.glob("*.json"))) == 2


@pytest.mark.parametrize("damage", [
    "{not json",
    json.dumps(["a list"]),
    json.dumps({"version": int8_trial.TRIAL_VERSION, "conditions": {"cpu": "another"}, "rows": {"Q4_K": 16}}),
    "rows of a trial that cannot be",  # (the conditions are right; the row count is not one the trial gives)
])
def test_a_damaged_entry_is_measured_again_never_fatal(trial_cache, monkeypatch, caplog, damage):
    int8_trial.int8_rows_that_pay("Q4_K")
    if damage == "rows of a trial that cannot be":
        entry = json.loads(trial_cache.path.read_text())
        damage = json.dumps({**entry, "rows": {"Q4_K": 999, "Q4_1": "4"}})
    trial_cache.path.write_text(damage)
    _new_process(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        assert int8_trial.int8_rows_that_pay("Q4_K") == 16
    assert trial_cache.measured == ["Q4_K", "Q4_K"]
    assert json.loads(trial_cache.path.read_text())["rows"] == {"Q4_K": 16}  # rewritten whole
    _new_process(monkeypatch)
    assert int8_trial.int8_rows_that_pay("Q4_K") == 16 and len(trial_cache.measured) == 2  # and kept


def test_an_unwritable_cache_folder_still_gives_the_trial(trial_cache, monkeypatch):
    def refuse(path, value):
        raise PermissionError("read-only")

    monkeypatch.setattr(int8_trial, "write_json_entry", refuse)
    assert int8_trial.int8_rows_that_pay("Q4_1") == 4 and not trial_cache.path.exists()


def test_auto_on_a_real_trial_takes_its_rows(tiny_gguf):
    """Without faking anything: each quantized weight takes int8 up to what the trial of its
    types gives on this machine, and of its width where narrower than the trial's (whatever that
    is: 0 where int8 never pays here)."""
    llm = LLM(str(tiny_gguf), max_model_len=128, num_gpu_blocks=64)
    try:
        for method in _quantized_methods(llm):
            trials = [int8_trial.int8_rows_that_pay(q) for q in method.qtypes]
            widths = [int8_trial.set_ways_for_width(q, method.in_features) for q in method.qtypes]
            assert method.int8_rows == min(*trials, *(widths if min(trials) else []))
    finally:
        llm.llm_engine.shutdown()


# --- the choice among int8 ways (AVX-512 VNNI or AMX beside AVX2) ------------------------------------


@pytest.fixture
def two_ways(monkeypatch):
    """A path with two int8 ways, "vnni" and "avx2", whose setting is recorded per (type,
    bucket) instead of reaching the C side; `timed` lists (rows, way) of each fake product."""
    state = SimpleNamespace(set={}, timed=[])
    monkeypatch.setattr(int8_trial.gguf_kernels, "int8_ways",
                        lambda qtype=None: ["avx2"] if qtype in ("IQ4_XS",) else ["vnni", "avx2"])
    monkeypatch.setattr(int8_trial.gguf_kernels, "set_int8_way",
                        lambda qtype, rows, way: state.set.__setitem__((qtype, rows), way))

    def matmul(x, w, int8=False):
        state.timed.append((x.shape[0], state.set[("Q4_K", x.shape[0])]))

    monkeypatch.setattr(int8_trial.gguf_kernels, "matmul", matmul)
    return state


def test_each_bucket_takes_the_way_its_timings_find_faster(two_ways, monkeypatch):
    """VNNI faked faster at 1 and 128+ rows, AVX2 in between: the choice follows the timings, both
    ways are timed at every bucket, and the C side is left on the winner."""
    def fake_time(fn, repeats):
        fn()
        rows, way = two_ways.timed[-1]
        vnni_wins = rows == 1 or rows >= 128
        return 1.0 if (way == "vnni") == vnni_wins else 2.0

    monkeypatch.setattr(int8_trial, "best_wall_time", fake_time)
    chosen = int8_trial.choose_ways("Q4_K")
    buckets = int8_trial.gguf_kernels.INT8_WAY_BUCKETS
    assert chosen == {rows: "vnni" if rows == 1 or rows >= 128 else "avx2" for rows in buckets}
    assert sorted(two_ways.timed) == sorted((rows, way) for rows in buckets for way in ("vnni", "avx2"))
    assert {rows: two_ways.set["Q4_K", rows] for rows in buckets} == chosen


def test_nothing_is_timed_where_there_is_no_choice(two_ways, monkeypatch):
    monkeypatch.setattr(int8_trial, "best_wall_time", lambda fn, repeats: pytest.fail("nothing to choose"))
    assert int8_trial.choose_ways("IQ4_XS") == {}  # (faked: one way for it)
    monkeypatch.setattr(int8_trial.gguf_kernels, "int8_ways", lambda qtype=None: ["portable"])
    assert int8_trial.choose_ways("Q4_K") == {}  # one way on this path


def test_rows_alone_is_not_timed_at_one_row(two_ways, monkeypatch):
    """One row of x is the same product either way: "avx2_rows" is timed from 2 rows, and no
    longer past the first bucket where it lost."""
    monkeypatch.setattr(int8_trial.gguf_kernels, "int8_ways", lambda qtype=None: ["avx2", "avx2_rows"])

    def fake_time(fn, repeats):
        fn()
        rows, way = two_ways.timed[-1]
        return 1.0 if (way == "avx2_rows") == (rows in (2, 4)) else 2.0

    monkeypatch.setattr(int8_trial, "best_wall_time", fake_time)
    chosen = int8_trial.choose_ways("Q4_K")
    assert chosen == {rows: "avx2_rows" if rows in (2, 4) else "avx2" for rows in int8_trial.gguf_kernels.INT8_WAY_BUCKETS}
    assert (1, "avx2_rows") not in two_ways.timed and (4, "avx2_rows") in two_ways.timed
    assert (8, "avx2_rows") in two_ways.timed and (16, "avx2_rows") not in two_ways.timed  # lost at 8: no more


def test_the_chosen_ways_are_kept_and_set_again_on_the_next_start(trial_cache, two_ways, monkeypatch):
    choice = {1: "vnni", 2: "avx2", 128: "vnni"}
    monkeypatch.setattr(int8_trial, "choose_ways", lambda qtype: trial_cache.measured.append("ways") or choice)
    assert int8_trial.int8_rows_that_pay("Q4_K") == 16
    assert trial_cache.measured == ["ways", "Q4_K"]  # the ways first: the rows are timed on them
    assert json.loads(trial_cache.path.read_text())["ways"] == {"Q4_K": {"1": "vnni", "2": "avx2", "128": "vnni"}}
    _new_process(monkeypatch)
    two_ways.set.clear()
    assert int8_trial.int8_rows_that_pay("Q4_K") == 16 and len(trial_cache.measured) == 2  # read, not timed
    assert two_ways.set == {("Q4_K", rows): way for rows, way in choice.items()}  # and set on the C side


@pytest.mark.parametrize("ways", [{"1": "amx"}, {"3": "vnni"}, ["vnni"], None])
def test_kept_ways_this_path_cannot_run_are_measured_again(trial_cache, two_ways, monkeypatch, ways):
    int8_trial.int8_rows_that_pay("Q4_K")
    entry = json.loads(trial_cache.path.read_text())
    trial_cache.path.write_text(json.dumps({**entry, "ways": {"Q4_K": ways}}))
    _new_process(monkeypatch)
    assert int8_trial.int8_rows_that_pay("Q4_K") == 16
    assert trial_cache.measured == ["Q4_K", "Q4_K"]
