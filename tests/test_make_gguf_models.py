"""benchmarks/make_gguf_models.py: the 1B and 8B shapes are Llama-3.2-1B's and Llama-3.1-8B's
(with the default tokenizer's 49152 tokens), the shards stay under their size, and the tiny
variant's folder is one `transformers` loads with the planned weights and the converter reads
(llama.cpp itself is not run here)."""

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
