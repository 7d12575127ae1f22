"""Checks of a model's files before any work: a broken file is a `ValueError` naming the file and
what is wrong with it, not a library's `IndexError` or `struct.error` from deep inside a reader.

- A GGUF file: empty, not GGUF (its magic), a version this reader does not know, counts of keys
  or tensors that the file's size cannot hold, a string or array running past the end, a tensor
  of an unknown type, with an empty or impossible shape, or whose data runs past the end of the
  file (truncated). Walked with `struct` over the header only (the vocabulary's strings
  included: a few tens of milliseconds).
- A Hugging Face folder: config.json that is not JSON, shards the index names that are missing,
  and every *.safetensors file's header (its length, its JSON, each tensor's dtype, shape and
  byte range against the file's size).
- Once the architecture is known (`check_tensor_shapes`): the shape of every tensor it fixes
  (embedding, lm_head, each layer's projections, biases, norms, router and experts), in every
  supported family, under GGUF's names or Hugging Face's (each family's names and shapes are
  its entry in `families`); 1-dimensional GGUF tensors (norms, biases) stored in a float type.

Torch-free; `gguf` (numpy) only for its table of quantized block sizes.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from pagedllm.transformers_utils.families import GGUF_TOP_TENSORS

GGUF_MAGIC = b"GGUF"
# GGUF value types -> struct formats of the fixed-size ones (8: string, 9: array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4
_FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16", 28: "F64"}
_SAFETENSORS_DTYPES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
}


@dataclass
class TensorInfo:
    name: str
    kind: str  # a ggml type's name, or a safetensors dtype
    shape: tuple[int, ...]  # torch's order (outermost first)


@dataclass
class CheckedFiles:
    """What the checks read: every tensor's type and shape, by name, and where each came from."""

    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)  # tensor name -> its file


def _quant_sizes() -> dict[int, tuple[str, int, int]]:
    """ggml type id -> (name, elements per block, bytes per block)."""
    import gguf

    return {int(t): (t.name, block, size) for t, (block, size) in gguf.GGML_QUANT_SIZES.items()}


class _Reader:
    def __init__(self, path: Path, data: bytes, endian: str) -> None:
        self.path, self.data, self.endian, self.pos = path, data, endian, 0

    def fail(self, what: str) -> ValueError:
        return ValueError(f"The GGUF file {self.path} is broken: {what}.")

    def take(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise self.fail(f"it is truncated: {what} at byte {self.pos} runs past the end of its {len(self.data)} bytes")
        value = struct.unpack_from(self.endian + fmt, self.data, self.pos)
        self.pos += size
        return value[0] if len(value) == 1 else value

    def string(self, what: str) -> str:
        length = self.take("Q", what)
        if self.pos + length > len(self.data):
            raise self.fail(
                f"it is truncated or its {what} is corrupt: a string of {length:,} bytes at byte {self.pos} runs past "
                f"the end of its {len(self.data):,} bytes"
            )
        raw = self.data[self.pos : self.pos + length]
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int, key: str):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind], f"the value of {key!r}")
        if kind == _STRING:
            return self.string(f"value of {key!r}")
        if kind == _ARRAY:
            item_kind = self.take("I", f"the array type of {key!r}")
            count = self.take("Q", f"the array length of {key!r}")
            if item_kind not in _SCALARS and item_kind not in (_STRING, _ARRAY):
                raise self.fail(f"the array {key!r} has items of an unknown type {item_kind}")
            least = 8 if item_kind in (_STRING, _ARRAY) else struct.calcsize(_SCALARS[item_kind])
            if count * least > len(self.data) - self.pos:
                raise self.fail(
                    f"the array {key!r} claims {count:,} items, more than the {len(self.data) - self.pos:,} bytes "
                    "left in the file can hold (truncated, or a corrupt count)"
                )
            if item_kind in _SCALARS:  # fixed-size items: step over them
                start = self.pos
                self.pos += count * least
                if key == "general.alignment" or count <= 16:
                    return list(struct.unpack_from(f"{self.endian}{count}{_SCALARS[item_kind]}", self.data, start))
                return count
            values = [self.value(item_kind, key) for _ in range(count)]
            return values if count <= 16 else count
        raise self.fail(f"the key {key!r} has a value of an unknown type {kind}")


def read_gguf_header(path: Path) -> CheckedFiles:
    """Walk the GGUF header of `path` and check it against the file's size; the tensors' table."""
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"The GGUF file {path} is empty (0 bytes).")
    with open(path, "rb") as handle:
        head = handle.read(4)
        if head != GGUF_MAGIC:
            raise ValueError(f"The file {path} is not a GGUF file: it starts with {head!r}, not {GGUF_MAGIC!r}.")
        import mmap

        data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _walk_gguf(path, data, size)
    finally:
        data.close()


def _walk_gguf(path: Path, data, size: int) -> CheckedFiles:
    probe = _Reader(path, data, "<")
    probe.pos = 4
    version = probe.take("I", "the version")
    endian = "<"
    if version > 0xFFFF:  # a big-endian file
        endian = ">"
        version = struct.unpack_from(">I", data, 4)[0]
    reader = _Reader(path, data, endian)
    reader.pos = 8
    if version not in (2, 3):
        raise reader.fail(f"its version is {version}; this reader knows GGUF versions 2 and 3")
    num_tensors = reader.take("Q", "the tensor count")
    num_keys = reader.take("Q", "the key count")
    left = size - reader.pos
    if num_keys * 13 > left or num_tensors * 24 > left:  # the smallest key and tensor entries
        raise reader.fail(
            f"it claims {num_keys:,} metadata keys and {num_tensors:,} tensors, more than its {size:,} bytes can hold "
            "(truncated, or corrupt counts)"
        )
    alignment = 32
    for _ in range(num_keys):
        key = reader.string("metadata key")
        kind = reader.take("I", f"the type of {key!r}")
        value = reader.value(kind, key)
        if key == "general.alignment":
            alignment = value if isinstance(value, int) else 32
    if alignment <= 0 or alignment & (alignment - 1):
        raise reader.fail(f"general.alignment is {alignment}, not a power of two")
    sizes = _quant_sizes()
    table = []
    for index in range(num_tensors):
        name = reader.string(f"name of tensor {index}")
        num_dims = reader.take("I", f"the dimension count of tensor {name!r}")
        if not 1 <= num_dims <= _MAX_DIMS:
            raise reader.fail(f"tensor {name!r} has {num_dims} dimensions (1 to {_MAX_DIMS} expected)")
        dims = [reader.take("Q", f"a dimension of tensor {name!r}") for _ in range(num_dims)]
        type_id = reader.take("I", f"the type of tensor {name!r}")
        offset = reader.take("Q", f"the data offset of tensor {name!r}")
        if type_id not in sizes:
            raise reader.fail(f"tensor {name!r} has an unknown ggml type {type_id}")
        if any(d == 0 for d in dims):
            raise reader.fail(f"tensor {name!r} has an empty dimension: {dims}")
        table.append((name, type_id, dims, offset))
    data_start = -(-reader.pos // alignment) * alignment
    checked = CheckedFiles()
    for name, type_id, dims, offset in table:
        type_name, block, block_bytes = sizes[type_id]
        if dims[0] % block:
            raise reader.fail(f"tensor {name!r} of type {type_name} has rows of {dims[0]} values, not whole blocks of {block}")
        nbytes = math.prod(dims) // block * block_bytes
        end = data_start + offset + nbytes
        if end > size:
            raise reader.fail(
                f"it is truncated: tensor {name!r} ({type_name}, {dims}) ends at byte {end:,}, past the end of its "
                f"{size:,} bytes"
            )
        checked.tensors[name] = TensorInfo(name, type_name, tuple(reversed(dims)))
        checked.files[name] = path
    return checked


def check_hf_folder(folder: Path) -> CheckedFiles:
    """config.json parses, the index's shards exist, and every shard's header is sound."""
    config = folder / "config.json"
    try:
        json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"The model's {config} is not valid JSON: {exc}.") from None
    index = folder / "model.safetensors.index.json"
    files = sorted(folder.glob("*.safetensors"))
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            named = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"The shard index {index} is broken (no valid weight_map): {exc}.") from None
        missing = [name for name in named if not (folder / name).is_file()]
        if missing:
            raise ValueError(f"The shard index {index} names shards that are missing from {folder}: {', '.join(missing[:5])}.")
    checked = CheckedFiles()  # no shards at all: the loader says so, after the architecture's checks
    for file in files:
        for info in read_safetensors_header(file):
            checked.tensors[info.name] = info
            checked.files[info.name] = file
    return checked


def read_safetensors_header(path: Path) -> list[TensorInfo]:
    def fail(what: str) -> ValueError:
        return ValueError(f"The safetensors file {path} is broken: {what}.")

    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"The safetensors file {path} is empty (0 bytes).")
    if size < 8:
        raise fail(f"it is truncated: {size} bytes, less than its 8-byte header length")
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if 8 + length > size:
            raise fail(f"it is truncated, or its header length is corrupt: a header of {length:,} bytes in a file of {size:,}")
        raw = handle.read(length)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise fail(f"its header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise fail("its header is not a JSON object")
    data_size = size - 8 - length
    infos = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise fail(f"tensor {name!r} has no dtype, shape and data_offsets") from None
        if dtype not in _SAFETENSORS_DTYPES:
            raise fail(f"tensor {name!r} has an unknown dtype {dtype!r}")
        if not isinstance(shape, list) or any(not isinstance(d, int) or d < 0 for d in shape):
            raise fail(f"tensor {name!r} has an invalid shape {shape!r}")
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise fail(f"tensor {name!r} has invalid data offsets {[begin, end]!r}")
        expected = math.prod(shape) * _SAFETENSORS_DTYPES[dtype]
        if end - begin != expected:
            raise fail(f"tensor {name!r} ({dtype}, {shape}) should take {expected:,} bytes, but its offsets span {end - begin:,}")
        if end > data_size:
            raise fail(f"it is truncated: tensor {name!r} ends at byte {8 + length + end:,}, past the end of its {size:,} bytes")
        infos.append(TensorInfo(name, dtype, tuple(shape)))
    return infos


def check_model_files(source) -> CheckedFiles:
    """The checks of the module docstring for a `ModelSource`, before anything else reads it."""
    if source.kind == "gguf":
        return read_gguf_header(source.path)
    return check_hf_folder(source.path)


# --- shapes against the architecture -----------------------------------------------------------

_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.(\w+?)(?:\.(\d+))?\.(weight|bias)$")  # (.E: one expert's, old files)
_HF_LAYER = re.compile(r"^model\.(?:decoder\.)?layers\.(\d+)\.(.+)$")
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _hf_name(name: str, arch) -> tuple[int | None, str]:
    """(layer or None, the tensor's name in the layer or the model) in Hugging Face terms, one
    expert's tensors as `mlp.experts.*.<proj>`."""
    match = _GGUF_LAYER.match(name)
    if match is not None:
        layer, part, expert, kind = match.groups()
        parts = arch.family.gguf_layer_tensors
        if expert is not None:
            return int(layer), f"mlp.experts.*.{part.removeprefix('ffn_')}_proj.{kind}"
        return int(layer), f"{parts.get(part, part)}.{kind}"
    base, _, kind = name.rpartition(".")
    if base in GGUF_TOP_TENSORS:
        return None, f"{GGUF_TOP_TENSORS[base]}.{kind}"
    if name.startswith("decoder."):  # OPT saved from OPTModel
        name = "model." + name
    match = _HF_LAYER.match(name)
    if match is None:
        return None, name.replace("model.decoder.", "model.")
    part = match.group(2).replace("block_sparse_moe.", "mlp.")
    part = re.sub(r"experts\.\d+\.", "experts.*.", part)
    part = re.sub(r"experts\.\*\.(w[123])\.", lambda m: f"experts.*.{_MIXTRAL_EXPERT[m.group(1)]}.", part)
    return int(match.group(1)), part


def check_tensor_shapes(checked: CheckedFiles, arch) -> None:
    """Every tensor the architecture fixes has its shape, in every supported family and either
    naming (GGUF's or Hugging Face's); every layer index is one it has; a GGUF file's 1-D tensors
    are stored as floats. `arch`: the file's `ModelArchConfig`."""
    gguf = any(name.startswith("blk.") or name == "token_embd.weight" for name in checked.tensors)
    layers = [arch.family.layer_shapes(arch, layer) for layer in range(arch.num_layers)]
    top = arch.family.model_shapes(arch)
    vocab_rows = ("model.embed_tokens.weight", "lm_head.weight")
    for name, info in checked.tensors.items():
        where = checked.files[name]

        def wrong(what: str) -> ValueError:
            return ValueError(f"The model file {where} does not match its architecture ({arch.architecture}): {what}.")

        if len(info.shape) == 1 and gguf and info.kind not in _FLOAT_TYPES.values():
            raise wrong(f"tensor {name!r} is 1-dimensional but stored as {info.kind}; norms and biases are floats")
        layer, part = _hf_name(name, arch)
        if layer is None and part in vocab_rows and len(info.shape) == 2:
            expected = (arch.vocab_size, arch.word_embed_proj_dim or arch.hidden_size)
            if info.shape[1] != expected[1] or info.shape[0] < arch.vocab_size:
                raise wrong(f"tensor {name!r} has shape {list(info.shape)}, expected {list(expected)} (vocabulary x hidden size)")
            continue
        if layer is not None and layer >= arch.num_layers:
            raise wrong(f"tensor {name!r} is of layer {layer}, but the model has {arch.num_layers} layers")
        shapes = top if layer is None else layers[layer]
        if part in shapes and info.shape != shapes[part]:
            raise wrong(f"tensor {name!r} has shape {list(info.shape)}, expected {list(shapes[part])}")
