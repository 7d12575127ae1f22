"""benchmarks/make_gguf_models.py: the 1B and 8B shapes are Llama-3.2-1B's and Llama-3.1-8B's
(with the default tokenizer's 49152 tokens), Qwen3-0.6B's has its own vocabulary, the shards stay
under their size, the tiny variant's folder is one `transformers` loads with the planned
weights and the converter reads (llama.cpp itself is not run here), and a Gemma 3 file scaled
to other widths keeps its keys and tokenizer and loads at the new shape."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "make_gguf_models.py"
_spec = importlib.util.spec_from_file_location("make_gguf_models", _PATH)
make_gguf_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_gguf_models)


@pytest.fixture(scope="module")
def tokenizer():
    from pagedllm.transformers_utils import get_tokenizer, resolve_model

    return get_tokenizer(resolve_model(None))


@pytest.mark.parametrize(
    "shape, layers, hidden, heads, kv_heads, head_dim, ffn, tied, billions",
    [("1b", 16, 2048, 32, 8, 64, 8192, True, 1.0738), ("8b", 32, 4096, 32, 8, 128, 14336, False, 7.3822)],
)
def test_shapes_are_llama_3s_with_the_default_vocabulary(tokenizer, shape, layers, hidden, heads, kv_heads, head_dim, ffn, tied, billions):
    config = make_gguf_models.llama_config(shape, tokenizer)
    assert (config.vocab_size, config.rope_parameters["rope_theta"]) == (49152, 500000.0)
    shapes = make_gguf_models.parameter_shapes(config)
    assert shapes["model.embed_tokens.weight"] == (49152, hidden)
    assert ("lm_head.weight" in shapes) is (not tied)
    assert shapes[f"model.layers.{layers - 1}.self_attn.q_proj.weight"] == (heads * head_dim, hidden)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (kv_heads * head_dim, hidden)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (ffn, hidden)
    assert f"model.layers.{layers}.mlp.up_proj.weight" not in shapes
    assert sum(make_gguf_models._numel(s) for s in shapes.values()) / 1e9 == pytest.approx(billions, abs=1e-4)


def test_qwen3_shape_is_qwen3_0_6bs_with_its_vocabulary(tokenizer):
    config = make_gguf_models.llama_config("qwen3-0.6b", tokenizer)
    assert (type(config).__name__, config.architectures, config.vocab_size) == ("Qwen3Config", ["Qwen3ForCausalLM"], 151936)
    shapes = make_gguf_models.parameter_shapes(config)
    assert shapes["model.layers.27.self_attn.q_proj.weight"] == (16 * 128, 1024)  # head_dim apart from 1024 / 16
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert "lm_head.weight" not in shapes  # tied
    assert sum(make_gguf_models._numel(s) for s in shapes.values()) / 1e9 == pytest.approx(0.5960, abs=1e-4)


def test_phi4_mini_and_the_moe_shape_are_those_models_and_readable_by_the_converter(tmp_path, tokenizer):
    config = make_gguf_models.llama_config("phi4-mini", tokenizer)
    shapes = make_gguf_models.parameter_shapes(config)
    assert sum(make_gguf_models._numel(s) for s in shapes.values()) / 1e9 == pytest.approx(3.8360, abs=1e-4)
    assert shapes["model.layers.31.self_attn.qkv_proj.weight"] == ((24 + 2 * 8) * 128, 3072)
    config.save_pretrained(str(tmp_path))
    tokenizer.save_pretrained(str(tmp_path))
    make_gguf_models._readable_by_the_converter(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    # llama.cpp's Phi-3 converter: LongRoPE's factors under rope_scaling (half the turning dims
    # each), a BPE vocabulary only from a GPT2Tokenizer
    assert written["rope_scaling"]["type"] == "longrope" and len(written["rope_scaling"]["long_factor"]) == 48
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "GPT2Tokenizer"
    moe = make_gguf_models.llama_config("qwen3-30b-a3b-8l", tokenizer)
    shapes = make_gguf_models.parameter_shapes(moe)
    assert shapes["model.layers.7.mlp.experts.gate_up_proj"] == (128, 2 * 768, 2048)  # Qwen3-30B-A3B's layer
    assert "model.layers.8.mlp.gate.weight" not in shapes and shapes["model.layers.0.mlp.gate.weight"] == (128, 2048)


def test_a_gemma3_file_scaled_to_other_widths_loads_at_them(tmp_path, tiny_models, monkeypatch):
    """The scaled file keeps every key of its source (the tokenizer's, the rotary bases, the
    window) but the widths and depth, and llama.cpp's tensor names at the new shape; pagedllm
    loads it as that shape, with the source's vocabulary."""
    import gguf

    from pagedllm.model import load_model
    from pagedllm.attention.reference import ReferenceAttentionBackend
    from pagedllm.transformers_utils import resolve_model
    from tests.gguf_writer import tokenizer_fields, write_gguf

    source = write_gguf(tiny_models("gemma3", sliding_window_pattern=6, num_hidden_layers=6), "gemma3",
                        tmp_path / "source.gguf", tokenizer=tokenizer_fields(resolve_model(None).path))
    monkeypatch.setitem(make_gguf_models.GEMMA3_SHAPES, "wider",
                        dict(embedding_length=96, feed_forward_length=160, block_count=3))
    scaled = make_gguf_models.scaled_gemma3(source, "wider", tmp_path / "wider-f16.gguf")
    old, new = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(scaled))
    assert new.fields["gemma3.embedding_length"].contents() == 96
    assert new.fields["gemma3.block_count"].contents() == 3
    for key in ("tokenizer.ggml.tokens", "gemma3.rope.freq_base", "gemma3.attention.sliding_window"):
        assert new.fields[key].contents() == old.fields[key].contents(), key
    tensors = {t.name: t for t in new.tensors}
    assert "blk.2.ffn_down.weight" in tensors and "blk.3.attn_q.weight" not in tensors
    assert tensors["blk.2.ffn_down.weight"].shape.tolist() == [160, 96]  # (innermost first)
    monkeypatch.setenv("PAGEDLLM_MODEL_CACHE", "0")
    model = load_model(resolve_model(str(scaled)), 256, ReferenceAttentionBackend(), __import__("torch").float32,
                       __import__("torch").device("cpu"))
    assert (model.cfg.hidden_size, model.cfg.intermediate_size, model.cfg.num_layers) == (96, 160, 3)
    assert model.cfg.vocab_size == len(old.fields["tokenizer.ggml.tokens"].contents())


def test_shards_stay_under_their_size_and_keep_every_tensor_once(tokenizer):
    shapes = make_gguf_models.parameter_shapes(make_gguf_models.llama_config("8b", tokenizer))
    plan = make_gguf_models.shard_plan(shapes)
    assert [name for shard in plan for name in shard] == list(shapes)
    assert all(sum(2 * make_gguf_models._numel(shapes[n]) for n in shard) <= make_gguf_models.SHARD_BYTES for shard in plan)
    assert len(plan) == 8  # 14.8 GB of float16 in 2 GiB shards


def test_tiny_folder_loads_in_transformers_with_the_planned_weights(tmp_path, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    folder = make_gguf_models.write_hf_folder("tiny", tmp_path / "tiny", seed=1, shard_bytes=200_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # written shard by shard
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float16)
    state = hf.state_dict()
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(state[name], make_gguf_models.random_tensor(name, tuple(state[name].shape), seed=1))
    assert 0.018 < state[name].float().std().item() < 0.022
    assert torch.equal(state["model.norm.weight"], torch.ones(64, dtype=torch.float16))
    # What llama.cpp's converter (transformers 4, its own config reader) needs to find.
    config = json.loads((folder / "config.json").read_text())
    assert (config["architectures"], config["rope_theta"], config["vocab_size"]) == (["LlamaForCausalLM"], 500000.0, 49152)
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (folder / "tokenizer.json").is_file()


def test_conversion_and_quantization_command_lines(tmp_path):
    convert = make_gguf_models.convert_command(Path("py"), Path("src"), Path("hf"), Path("f16.gguf"))
    assert convert == ["py", "src/convert_hf_to_gguf.py", "hf", "--outtype", "f16", "--outfile", "f16.gguf"]
    quantize = make_gguf_models.quantize_command(Path("bin"), Path("f16.gguf"), Path("q.gguf"), threads=2)
    assert quantize == ["bin/llama-quantize", "f16.gguf", "q.gguf", "Q4_K_M", "2"]
