"""Start-up: what is derived from a GGUF file (architecture, tokenizer, weights in the form the
model computes with) is cached under the cache folder, keyed by the file's bytes; a warm start
maps it instead of parsing and dequantizing, gives bit-identical results, and never trusts a
broken or stale entry. The start-up log reports where memory goes and the time to ready."""

from __future__ import annotations

import logging
import mmap
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagedllm.attention.reference import ReferenceAttentionBackend
from pagedllm.kernels import onednn
from pagedllm.model import load_model, loader, weight_cache
from pagedllm.model.memory import memory_budget
from pagedllm.model.quant import GGUFLinear, method_layers
from pagedllm.transformers_utils import arch as arch_module
from pagedllm.transformers_utils import file_cache
from pagedllm.transformers_utils.source import ModelSource
from tests.server.common import SERVE_FLAGS
from tests.test_model import PagedSequences

CPU = torch.device("cpu")
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 256


def write_tiny_gguf(path: Path, seed: int = 0, projections=gguf.GGMLQuantizationType.Q4_1) -> Path:
    """A two-layer llama GGUF file with random weights: projections in Q4_1 (or `projections`),
    the (tied) embedding in Q8_0, norms in F32, q/k rows permuted as llama.cpp stores them."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    # A vocabulary, as real files carry one (start-up reads its length only).
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"tok{i}" for i in range(VOCAB)])
    writer.add_token_merges([f"tok{i} tok{i + 1}" for i in range(VOCAB - 1)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def quantized(name: str, rows: int, cols: int, qtype=projections) -> None:
        dense = (rng.standard_normal((rows, cols)) * 0.3).astype(np.float32)
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, dense)
        else:
            writer.add_tensor(name, gguf.quants.quantize(dense, qtype), raw_dtype=qtype)

    head_dim = HIDDEN // HEADS
    quantized("token_embd.weight", VOCAB, HIDDEN, gguf.GGMLQuantizationType.Q8_0)
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        quantized(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN)
        quantized(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        quantized(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        quantized(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head_dim)
        quantized(f"blk.{i}.ffn_gate.weight", INTERMEDIATE, HIDDEN)
        quantized(f"blk.{i}.ffn_up.weight", INTERMEDIATE, HIDDEN)
        quantized(f"blk.{i}.ffn_down.weight", HIDDEN, INTERMEDIATE)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def forget_this_process() -> None:
    """What a new process would not know: the file hashes and GGUF metadata read so far."""
    file_cache._digests.clear()
    arch_module._gguf_metadata.clear()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A private cache folder (never the user's), and a process that has read no file yet."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(folder))
    monkeypatch.delenv("PAGEDLLM_MODEL_CACHE", raising=False)
    forget_this_process()
    yield folder
    forget_this_process()


@pytest.fixture
def tiny_gguf(tmp_path) -> ModelSource:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    return ModelSource("tiny", "gguf", path)


def load(source: ModelSource):
    return load_model(source, 256, ReferenceAttentionBackend(), torch.float32, CPU)


def uncached(source: ModelSource, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv("PAGEDLLM_MODEL_CACHE", "0")
        return load(source)


def entries(cache: Path) -> list[Path]:
    root = cache / "weights"
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []


def assert_same_weights(a, b) -> None:
    params_a, params_b = dict(a.named_parameters()), dict(b.named_parameters())
    assert params_a.keys() == params_b.keys()
    for name, pa in params_a.items():
        pb = params_b[name]
        assert torch.equal(pa, pb), name
    methods_a, methods_b = method_layers(a), method_layers(b)
    assert methods_a.keys() == methods_b.keys()
    for name, layer in methods_a.items():
        assert layer.quant_method.cache_description == methods_b[name].quant_method.cache_description, name


def greedy_run(model, prompt_len: int = 20, steps: int = 6) -> tuple[torch.Tensor, list[int]]:
    """Prefill logits (enough rows for the oneDNN path) and greedy decode tokens (one row: the
    quantized kernel's path)."""
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    run = PagedSequences(model, block_size=16, num_blocks=16)
    logits = run.run([prompt])[0]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps):
        tokens.append(int(run.run([[tokens[-1]]])[0][-1].argmax()))
    return logits, tokens


# --- the weight cache ---------------------------------------------------------------------------

def test_cached_weights_give_bit_identical_results(cache, tiny_gguf, monkeypatch):
    reference = uncached(tiny_gguf, monkeypatch)
    assert not entries(cache)
    cold = load(tiny_gguf)  # builds the entry, then serves from it
    assert len(entries(cache)) == 1
    forget_this_process()
    warm = load(tiny_gguf)
    ref_logits, ref_tokens = greedy_run(reference)
    for model in (cold, warm):
        assert_same_weights(reference, model)
        logits, tokens = greedy_run(model)
        assert torch.equal(logits, ref_logits) and tokens == ref_tokens


def test_a_warm_load_neither_parses_nor_dequantizes_the_file(cache, tiny_gguf, monkeypatch):
    first = load(tiny_gguf)
    forget_this_process()  # as a new process would start

    def refuse(*args, **kwargs):
        raise AssertionError("a warm start must not read the GGUF file this way")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    monkeypatch.setattr(arch_module, "parse_gguf_metadata", refuse)
    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    monkeypatch.setattr(loader, "_load_from_source", refuse)
    assert_same_weights(first, load(tiny_gguf))


def test_a_rewritten_file_misses_the_cache_even_with_the_same_name_size_and_time(cache, tiny_gguf, monkeypatch):
    path = tiny_gguf.path
    load(tiny_gguf)
    stat = path.stat()
    write_tiny_gguf(path, seed=1)  # other weights, same layout
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    reloaded = load(tiny_gguf)
    assert len(entries(cache)) == 2
    forget_this_process()
    assert_same_weights(uncached(tiny_gguf, monkeypatch), reloaded)


def test_the_file_digest_follows_the_bytes_not_the_metadata(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"a" * 1000)
    stat = path.stat()
    before = file_cache.file_digest(path)
    path.write_bytes(b"b" * 1000)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert file_cache.file_digest(path) != before
    file_cache._digests.clear()  # and in a fresh process too
    assert file_cache.file_digest(path) != before


def _truncate(entry: Path) -> None:
    weights = entry / weight_cache.WEIGHTS_FILE
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)


def _flip_a_byte(entry: Path) -> None:
    weights = entry / weight_cache.WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[len(data) * 3 // 4] ^= 0x40  # inside a tensor: the size and header still look right
    weights.write_bytes(bytes(data))


def _garble_manifest(entry: Path) -> None:
    (entry / weight_cache.MANIFEST_FILE).write_text("{not json")


def _drop_weights(entry: Path) -> None:
    (entry / weight_cache.WEIGHTS_FILE).unlink()


def _wrong_shape(entry: Path) -> None:
    """A whole, checksummed file whose tensors do not fit the model (say, another file's)."""
    from safetensors.torch import save_file

    path = entry / weight_cache.WEIGHTS_FILE
    save_file({"model.norm.weight": torch.ones(3)}, str(path), metadata={"quantized": "{}"})
    manifest = file_cache.read_json(entry / weight_cache.MANIFEST_FILE)
    manifest.update(size=path.stat().st_size, crc32=weight_cache._file_crc32(path))
    (entry / weight_cache.MANIFEST_FILE).write_text(__import__("json").dumps(manifest))


@pytest.mark.parametrize("damage", [_truncate, _flip_a_byte, _garble_manifest, _drop_weights, _wrong_shape])
def test_a_broken_entry_is_rebuilt_never_used(cache, tiny_gguf, monkeypatch, caplog, damage):
    reference = uncached(tiny_gguf, monkeypatch)
    load(tiny_gguf)
    (entry,) = entries(cache)
    damage(entry)
    forget_this_process()
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        rebuilt = load(tiny_gguf)
    assert_same_weights(reference, rebuilt)
    assert "Discarding the cached weights" in caplog.text or damage is _drop_weights
    forget_this_process()
    monkeypatch.setattr(loader, "_load_from_source", lambda *a: pytest.fail("the rebuilt entry should be used"))
    assert_same_weights(reference, load(tiny_gguf))


def test_concurrent_writers_leave_one_whole_entry(cache, tiny_gguf, monkeypatch):
    model = uncached(tiny_gguf, monkeypatch)
    entry = weight_cache.entry_path(tiny_gguf, torch.float32, CPU, model.tp)
    barrier = threading.Barrier(4)
    errors = []

    def write() -> None:
        try:
            barrier.wait()
            weight_cache.save(model, entry, {"writer": threading.get_ident()})
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [p.name for p in (cache / "weights").iterdir()] == [entry.name]  # no staging left behind
    fresh = load(tiny_gguf)
    assert_same_weights(model, fresh)


def test_entries_unused_for_long_are_swept_when_another_is_written(cache, tiny_gguf, tmp_path, monkeypatch):
    load(tiny_gguf)
    (old,) = entries(cache)
    long_ago = old.stat().st_mtime - (weight_cache.UNUSED_ENTRY_DAYS + 1) * 86400
    os.utime(old / weight_cache.MANIFEST_FILE, (long_ago, long_ago))
    other = ModelSource("other", "gguf", write_tiny_gguf(tmp_path / "other.gguf", seed=2))
    load(other)
    assert [e.name.split("-")[0] for e in entries(cache)] == ["other"]


def test_entries_built_by_other_code_are_swept_once_unused_for_an_hour(cache, tiny_gguf, tmp_path, monkeypatch):
    """An upgrade's first start removes what the old code built for the same file and settings
    (it can never be read again), once it is not in use by a version started beside it."""
    def aged(entry: Path, hours: float) -> None:
        then = time.time() - hours * 3600
        os.utime(entry / weight_cache.MANIFEST_FILE, (then, then))

    other = ModelSource("other", "gguf", write_tiny_gguf(tmp_path / "other.gguf", seed=2))
    load(other)
    (other_entry,) = entries(cache)
    load(tiny_gguf)
    (old,) = set(entries(cache)) - {other_entry}
    monkeypatch.setattr(weight_cache, "_code_digest", lambda: "an upgrade")
    load(tiny_gguf)  # the old code's entry was used a moment ago: a version beside this one may need it
    (upgraded,) = set(entries(cache)) - {other_entry, old}
    for entry in (other_entry, old):
        aged(entry, weight_cache.SUPERSEDED_ENTRY_HOURS + 0.1)
    monkeypatch.setattr(weight_cache, "_code_digest", lambda: "a second upgrade")
    load(tiny_gguf)
    (newest,) = set(entries(cache)) - {other_entry, old, upgraded}
    # the old code's entry is gone; the other file's, as old, and the upgrade's, fresh, are kept
    assert set(entries(cache)) == {other_entry, upgraded, newest}


def test_a_writer_that_fails_publishes_nothing(cache):
    final = cache / "weights" / "entry"
    with pytest.raises(RuntimeError):
        with file_cache.staged_entry(final) as staging:
            (staging / "half").write_bytes(b"x")
            raise RuntimeError("the disk filled up")
    assert not final.exists() and list(final.parent.iterdir()) == []


def test_the_cache_can_be_turned_off(cache, tiny_gguf, monkeypatch):
    uncached(tiny_gguf, monkeypatch)
    assert not (cache / "weights").exists() and not (cache / "gguf-metadata").exists()


# --- GGUF metadata ------------------------------------------------------------------------------

def test_gguf_metadata_is_parsed_once_then_read_from_the_cache(cache, tiny_gguf, monkeypatch):
    calls = []
    parse = arch_module.parse_gguf_metadata
    monkeypatch.setattr(arch_module, "parse_gguf_metadata", lambda path: calls.append(1) or parse(path))
    cfg = arch_module.load_arch_config(tiny_gguf)
    load(tiny_gguf)  # the same process: no second parse for the weights
    assert len(calls) == 1
    forget_this_process()
    assert arch_module.load_arch_config(tiny_gguf) == cfg and len(calls) == 1
    (saved,) = (cache / "gguf-metadata").iterdir()
    saved.write_text("[1, 2")  # damaged: parsed again and rewritten
    forget_this_process()
    assert arch_module.load_arch_config(tiny_gguf) == cfg and len(calls) == 2
    assert file_cache.read_json(saved) is not None


def test_both_gguf_parsers_read_the_same_metadata(tiny_gguf):
    fast = arch_module.parse_gguf_metadata(tiny_gguf.path)
    reference = arch_module.read_gguf_metadata(gguf.GGUFReader(str(tiny_gguf.path)))
    assert fast["tensors"] == reference["tensors"]
    assert arch_module.gguf_arch_config(fast) == arch_module.gguf_arch_config(reference)
    cfg = arch_module.gguf_arch_config(fast)
    assert (cfg.vocab_size, cfg.num_layers, cfg.bos_token_id, cfg.eos_token_ids) == (VOCAB, LAYERS, 1, [2])
    assert cfg.tie_word_embeddings


# --- memory -------------------------------------------------------------------------------------

def present_pages(tensor: torch.Tensor) -> int:
    """How many whole pages inside `tensor` are mapped into this process (/proc/self/pagemap)."""
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    first, last = -(-start // page), (start + tensor.numel() * tensor.element_size()) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first) * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum())


@pytest.mark.skipif(not sys.platform.startswith("linux") or not onednn.available(), reason="Linux and oneDNN")
def test_a_warm_model_keeps_one_copy_of_each_projection(cache, tmp_path):
    """oneDNN reads its packed copy of a float (F32 GGUF) projection; the float pages it was
    packed from go back to the file and stay there through prefill and decode (the embedding
    table, read by row, is left alone)."""
    source = ModelSource("tiny-f32", "gguf", write_tiny_gguf(tmp_path / "f32.gguf", projections=gguf.GGMLQuantizationType.F32))
    load(source)
    forget_this_process()
    model = load(source)
    layers = [m for m in method_layers(model).values() if getattr(m.quant_method, "packed", None) is not None]
    projections = [m.weight for m in layers if m.weight is not model.embedding_weight]
    assert projections
    total = sum(p.numel() * p.element_size() for p in projections) // mmap.PAGESIZE
    assert sum(present_pages(p) for p in projections) == 0
    greedy_run(model)
    # Reading the norms and embedding rows beside them maps a few neighbouring pages too (the
    # kernel's fault-around), but the projections themselves are never read.
    assert sum(present_pages(p) for p in projections) < total // 10


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux")
def test_a_warm_quantized_model_maps_the_packed_blocks_from_a_file_of_the_gguf_size(cache, tiny_gguf):
    """The weight cache of a quantized GGUF holds the packed blocks the kernels read (about the
    file's bytes, not float32's), and a warm start computes from them in the mapped file."""
    load(tiny_gguf)
    forget_this_process()
    model = load(tiny_gguf)
    (entry,) = entries(cache)
    gguf_size = tiny_gguf.path.stat().st_size
    float32_size = 4 * sum(n for n in (VOCAB * HIDDEN, LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE)))
    assert (entry / weight_cache.WEIGHTS_FILE).stat().st_size < 1.3 * gguf_size < float32_size / 4
    spans = weight_cache.cache_file_mappings()
    for layer in method_layers(model).values():
        assert isinstance(layer.quant_method, GGUFLinear)
        start = layer.weight.data_ptr()
        assert any(lo <= start < hi for lo, hi, _ in spans)


def test_the_budget_adds_up(cache, tiny_gguf):
    model = load(tiny_gguf)
    run = PagedSequences(model, block_size=16, num_blocks=64)
    # 64 MiB each of fresh pages from the OS: mapped here, not from malloc, whose heap may hold
    # pages an earlier test touched once an engine has raised glibc's mmap threshold.
    mappings = [mmap.mmap(-1, 64 << 20) for _ in range(2)]
    swap = [torch.frombuffer(m, dtype=torch.float32).view(1024, 16 * 1024) for m in mappings]
    swap[0][:2] = 1  # a swap pool is resident only where something was swapped out
    budget = memory_budget(model, run.keys + run.values, swap)
    kv_bytes = sum(t.numel() * t.element_size() for t in run.keys + run.values)
    page = mmap.PAGESIZE
    # Zeroed at allocation: all resident (pages these small pools share with neighbours aside).
    assert kv_bytes - 2 * page * len(run.keys + run.values) <= budget.kv_cache <= kv_bytes + 2 * page * len(run.keys)
    # Two rows written (128 KiB, which straddle one more page when the data is not page-aligned),
    # plus the allocator's header page at the start of each pool's mapping.
    assert budget.kv_cache_reserved == kv_bytes
    assert 0 < budget.swap_pool <= 2 * 16 * 1024 * 4 + page * (2 + len(swap))
    assert budget.swap_pool_reserved == 2 * (64 << 20)
    assert budget.weights_resident > 0 and budget.rest > 0
    assert budget.weights_resident + budget.kv_cache + budget.swap_pool + budget.rest == budget.rss
    assert re.fullmatch(
        r"Memory: weights [\d.]+ [MG]iB \([\d.]+ [MG]iB of it resident\), KV cache [\d.]+ [MG]iB \(of [\d.]+ [MG]iB reserved\), "
        r"swap pool [\d.]+ [MG]iB \(of [\d.]+ [MG]iB reserved\), rest [\d.]+ [MG]iB \(RSS [\d.]+ [MG]iB\)",
        str(budget),
    )


def test_serve_logs_its_memory_budget_and_time_to_ready(tiny_llama):
    command = [sys.executable, "-m", "pagedllm.cli", "serve", str(tiny_llama), "--port", "0", *SERVE_FLAGS]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in process.stderr:
            lines.append(line)
            if "Ready in" in line or "Traceback" in line:
                break
    finally:
        process.terminate()
        process.wait(30)
    log = "".join(lines)
    size = r"([\d.]+ [MG]iB)"
    budget = re.search(rf"Memory: weights [\d.]+ [MG]iB \({size} of it resident\), KV cache {size} \(of [\d.]+ [MG]iB reserved\), "
                       rf"swap pool {size} \(of [\d.]+ [MG]iB reserved\), rest {size} \(RSS {size}\)", log)
    assert budget, log
    *parts, rss = (float(n) * (1 if unit == "GiB" else 2**-10) for n, unit in (g.split() for g in budget.groups()))
    assert abs(sum(parts) - rss) <= 0.02  # each figure rounded to 0.01 GiB (or 0.1 MiB)
    ready = re.search(r"Ready in ([\d.]+) s", log)
    assert ready and 0 < float(ready.group(1)) < 600, log
