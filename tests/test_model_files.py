"""Broken model files are refused before any work with a `ValueError` naming the file and what is
wrong (pagedllm.transformers_utils.file_checks), never a library's IndexError or struct.error:
GGUF files empty, not GGUF, truncated in the header or the data, with impossible counts, a
tensor of the wrong shape or type; Hugging Face folders with an empty, truncated or missing
shard, a header that is not JSON, a tensor of the wrong shape, a config.json that is not JSON."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from pagedllm import LLM
from pagedllm.transformers_utils import load_arch_config, resolve_model
from tests.test_startup import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, VOCAB, write_tiny_gguf

HEAD_DIM = HIDDEN // HEADS


def arch_of(path: Path):
    return load_arch_config(resolve_model(str(path)))


def refused(path: Path, match: str, named: Path | None = None) -> str:
    with pytest.raises(ValueError, match=match) as error:
        arch_of(path)
    assert str(named or path) in str(error.value)
    return str(error.value)


@pytest.fixture
def good_gguf(tmp_path) -> Path:
    path = write_tiny_gguf(tmp_path / "good.gguf")
    assert arch_of(path).num_layers == LAYERS  # the file the cases below break
    return path


def broken(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "broken.gguf"
    path.write_bytes(data)
    return path


def test_an_empty_gguf_file(tmp_path):
    refused(broken(tmp_path, b""), "is empty")


def test_a_file_that_is_not_gguf(tmp_path, good_gguf):
    refused(broken(tmp_path, b"GGML" + good_gguf.read_bytes()[4:]), "is not a GGUF file: it starts with b'GGML'")


def test_a_gguf_file_truncated_in_its_header(tmp_path, good_gguf):
    for cut in (6, 20, 300, 3000):
        refused(broken(tmp_path, good_gguf.read_bytes()[:cut]), "truncated")


def test_a_gguf_file_truncated_in_its_data(tmp_path, good_gguf):
    message = refused(broken(tmp_path, good_gguf.read_bytes()[:-100]), "truncated: tensor")
    assert "output_norm.weight" in message


def test_a_gguf_file_with_impossible_counts(tmp_path, good_gguf):
    data = bytearray(good_gguf.read_bytes())
    data[8:16] = struct.pack("<Q", 10**12)  # the tensor count
    refused(broken(tmp_path, bytes(data)), "and 1,000,000,000,000 tensors, more than")
    data = bytearray(good_gguf.read_bytes())
    data[16:24] = struct.pack("<Q", 10**15)  # the key count
    refused(broken(tmp_path, bytes(data)), "metadata keys")
    data = bytearray(good_gguf.read_bytes())
    data[4:8] = struct.pack("<I", 7)
    refused(broken(tmp_path, bytes(data)), "version is 7")


def write_llama_gguf(path: Path, wrong: dict[str, np.ndarray]) -> Path:
    """A float32 two-layer llama file whose tensors named in `wrong` are replaced."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, LAYERS), (writer.add_context_length, 256),
                       (writer.add_embedding_length, HIDDEN), (writer.add_feed_forward_length, INTERMEDIATE),
                       (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_vocab_size, VOCAB)):
        add(value)
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes |= {f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                   f"blk.{i}.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN), f"blk.{i}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                   f"blk.{i}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN), f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
                   f"blk.{i}.ffn_gate.weight": (INTERMEDIATE, HIDDEN), f"blk.{i}.ffn_up.weight": (INTERMEDIATE, HIDDEN),
                   f"blk.{i}.ffn_down.weight": (HIDDEN, INTERMEDIATE)}
    for name, shape in shapes.items():
        if name in wrong:
            value = wrong[name]
            qtype = gguf.GGMLQuantizationType.Q8_0 if value.dtype == np.uint8 else None
            writer.add_tensor(name, value, raw_dtype=qtype)
        else:
            writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_tensor_of_the_wrong_shape_or_type(tmp_path):
    assert arch_of(write_llama_gguf(tmp_path / "fine.gguf", {})).hidden_size == HIDDEN
    wrong_k = np.zeros((HEADS * HEAD_DIM, HIDDEN), np.float32)  # as many key heads as query heads
    message = refused(write_llama_gguf(tmp_path / "k.gguf", {"blk.1.attn_k.weight": wrong_k}), "does not match")
    assert f"'blk.1.attn_k.weight' has shape [{HEADS * HEAD_DIM}, {HIDDEN}], expected [{KV_HEADS * HEAD_DIM}, {HIDDEN}]" in message
    short_embedding = np.zeros((VOCAB, HIDDEN // 2), np.float32)
    refused(write_llama_gguf(tmp_path / "e.gguf", {"token_embd.weight": short_embedding}), "vocabulary x hidden size")
    quantized_norm = gguf.quants.quantize(np.ones((1, HIDDEN), np.float32), gguf.GGMLQuantizationType.Q8_0)[0]
    refused(write_llama_gguf(tmp_path / "n.gguf", {"blk.0.attn_norm.weight": quantized_norm}), "stored as Q8_0")


def test_the_engine_refuses_a_broken_gguf_file_with_the_same_error(tmp_path, good_gguf):
    path = broken(tmp_path, good_gguf.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"The GGUF file {path} is broken: it is truncated"):
        LLM(str(path), max_model_len=128)


# --- Hugging Face folders ---------------------------------------------------------------------

@pytest.fixture
def folder(tmp_path, tiny_llama) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(tiny_llama, copy)
    return copy


def test_a_shard_empty_truncated_or_with_a_broken_header(folder):
    shard = folder / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(b"")
    refused(folder, "is empty", shard)
    shard.write_bytes(data[:5])
    refused(folder, "less than its 8-byte header length", shard)
    shard.write_bytes(data[:1000])
    refused(folder, "truncated", shard)
    shard.write_bytes(data[: len(data) - 64])
    refused(folder, "truncated: tensor", shard)
    (length,) = struct.unpack("<Q", data[:8])
    shard.write_bytes(data[:8] + b"{not json" + data[17:])
    refused(folder, "header is not valid JSON", shard)


def test_a_shard_named_by_the_index_but_missing(folder):
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(folder, "missing from", folder / "model.safetensors.index.json")


def test_a_safetensors_tensor_of_the_wrong_shape(folder):
    from safetensors.numpy import load_file, save_file

    shard = folder / "model.safetensors"
    state = load_file(str(shard))
    name = "model.layers.0.self_attn.q_proj.weight"
    rows, cols = state[name].shape
    state[name] = np.zeros((rows // 2, cols), dtype=state[name].dtype)
    save_file(state, str(shard), metadata={"format": "pt"})
    message = refused(folder, "does not match its architecture", shard)
    assert f"{name!r} has shape [{rows // 2}, {cols}], expected [{rows}, {cols}]" in message


def test_a_config_that_is_not_json(folder):
    (folder / "config.json").write_text('{"architectures": [')
    refused(folder, "is not valid JSON", folder / "config.json")


# --- every family's tensors -------------------------------------------------------------------

# (family, a tensor whose shape only that family's checks know)
FAMILY_TENSORS = [
    ("qwen2", "model.layers.0.self_attn.k_proj.bias"),
    ("qwen3", "model.layers.1.self_attn.k_norm.weight"),
    ("gemma2", "model.layers.0.post_feedforward_layernorm.weight"),
    ("gemma3", "model.layers.1.self_attn.q_norm.weight"),
    ("phi3", "model.layers.1.self_attn.qkv_proj.weight"),
    ("mixtral", "model.layers.1.block_sparse_moe.experts.0.w2.weight"),
    ("qwen3_moe", "model.layers.0.mlp.experts.1.up_proj.weight"),
    ("opt", "model.decoder.layers.0.fc1.weight"),
]


@pytest.mark.parametrize("family, name", FAMILY_TENSORS, ids=[family for family, _ in FAMILY_TENSORS])
def test_a_safetensors_tensor_of_the_wrong_shape_in_every_family(tmp_path, family, name):
    from safetensors.numpy import load_file, save_file

    from tests.helpers import tiny_hf_model

    tiny_hf_model(family).save_pretrained(str(tmp_path))
    arch_of(tmp_path)  # the family's own file passes
    shard = tmp_path / "model.safetensors"
    state = load_file(str(shard))
    right = list(state[name].shape)
    wrong = [right[0] - 1, *right[1:]]
    state[name] = np.zeros(wrong, dtype=state[name].dtype)
    save_file(state, str(shard), metadata={"format": "pt"})
    message = refused(tmp_path, "does not match its architecture", shard)
    assert f"{name!r} has shape {wrong}, expected {right}" in message


def write_gguf(path: Path, arch: str, fields: dict[str, int], shapes: dict[str, tuple[int, ...]]) -> Path:
    """A float32 GGUF file of `arch` with these integer metadata fields and tensors (zeros)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in fields.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    for name, shape in shapes.items():
        writer.add_tensor(name, np.zeros(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_family(arch: str) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
    """One layer of Phi-3 (q, k, v fused; gate and up fused) or Qwen3-MoE (query and key norms,
    four stacked experts of width 48), under llama.cpp's names."""
    q, kv, experts, width = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, 4, 48
    fields = {"block_count": 1, "context_length": 256, "embedding_length": HIDDEN, "feed_forward_length": INTERMEDIATE,
              "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS, "vocab_size": VOCAB}
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,), "blk.0.attn_norm.weight": (HIDDEN,),
              "blk.0.ffn_norm.weight": (HIDDEN,), "blk.0.attn_output.weight": (HIDDEN, q)}
    if arch == "phi3":
        return fields, shapes | {"blk.0.attn_qkv.weight": (q + 2 * kv, HIDDEN), "blk.0.ffn_up.weight": (2 * INTERMEDIATE, HIDDEN),
                                 "blk.0.ffn_down.weight": (HIDDEN, INTERMEDIATE)}
    fields |= {"expert_count": experts, "expert_used_count": 2, "expert_feed_forward_length": width}
    return fields, shapes | {
        "blk.0.attn_q.weight": (q, HIDDEN), "blk.0.attn_k.weight": (kv, HIDDEN), "blk.0.attn_v.weight": (kv, HIDDEN),
        "blk.0.attn_q_norm.weight": (HEAD_DIM,), "blk.0.attn_k_norm.weight": (HEAD_DIM,),
        "blk.0.ffn_gate_inp.weight": (experts, HIDDEN), "blk.0.ffn_gate_exps.weight": (experts, width, HIDDEN),
        "blk.0.ffn_up_exps.weight": (experts, width, HIDDEN), "blk.0.ffn_down_exps.weight": (experts, HIDDEN, width),
    }


@pytest.mark.parametrize("arch, name", [("phi3", "blk.0.ffn_up.weight"), ("phi3", "blk.0.attn_qkv.weight"),
                                        ("qwen3moe", "blk.0.ffn_down_exps.weight"), ("qwen3moe", "blk.0.attn_k_norm.weight")])
def test_a_gguf_tensor_of_the_wrong_shape_in_other_families(tmp_path, arch, name):
    fields, shapes = _gguf_family(arch)
    arch_of(write_gguf(tmp_path / "fine.gguf", arch, fields, shapes))  # the family's own shapes pass
    right = list(shapes[name])
    wrong = [*right[:-1], right[-1] // 2]  # GGUF lists dimensions fastest first: halve the rows' width
    path = write_gguf(tmp_path / "wrong.gguf", arch, fields, shapes | {name: tuple(wrong)})
    message = refused(path, "does not match its architecture")
    assert f"{name!r} has shape {wrong}, expected {right}" in message
