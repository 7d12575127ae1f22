"""Lazy checkpoint tensors: a weight is read (and dequantized) only when a layer asks for it, and
only the slice the layer asks for, so a tensor-parallel rank reads just its own shard.

A `LazyWeight` has a `shape`, `narrow(dim, start, length)` (returns another lazy weight), and
`load()` (returns a float tensor). Sources: a tensor in memory, a safetensors file, a GGUF file.
A GGUF weight may also offer `load_native()`: its slice as the kernels read it (the blocks, or a
16-bit tensor), which the layer's method keeps instead of a float copy (`model/quant/`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch


class LazyWeight(Protocol):
    shape: tuple[int, ...]

    def narrow(self, dim: int, start: int, length: int) -> "LazyWeight": ...

    def load(self) -> torch.Tensor: ...


def _narrowed_ranges(
    shape: tuple[int, ...], ranges: tuple[range, ...], dim: int, start: int, length: int
) -> tuple[range, ...]:
    if not 0 <= start and start + length <= shape[dim]:
        raise ValueError(f"narrow({dim}, {start}, {length}) is out of bounds for shape {shape}")
    old = ranges[dim]
    return ranges[:dim] + (range(old.start + start, old.start + start + length),) + ranges[dim + 1 :]


class TensorWeight:
    """A tensor already in memory."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.shape = tuple(tensor.shape)

    def narrow(self, dim: int, start: int, length: int) -> "TensorWeight":
        return TensorWeight(self.tensor.narrow(dim, start, length))

    def load(self) -> torch.Tensor:
        return self.tensor


class SafetensorsWeight:
    """One tensor of an open safetensors file, read lazily (only the requested slice)."""

    def __init__(self, handle, name: str, ranges: tuple[range, ...] | None = None) -> None:
        self.handle = handle
        self.name = name
        if ranges is None:
            ranges = tuple(range(n) for n in handle.get_slice(name).get_shape())
        self.ranges = ranges
        self.shape = tuple(len(r) for r in ranges)

    def narrow(self, dim: int, start: int, length: int) -> "SafetensorsWeight":
        return SafetensorsWeight(self.handle, self.name, _narrowed_ranges(self.shape, self.ranges, dim, start, length))

    def load(self) -> torch.Tensor:
        index = tuple(slice(r.start, r.stop) for r in self.ranges)
        return self.handle.get_slice(self.name)[index] if index else self.handle.get_tensor(self.name)


def unpermute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of the query/key projection rows.

    llama.cpp stores each head's rows interleaved (pairs of rotary dimensions next to each other);
    Hugging Face checkpoints, and our rotary embedding, put the two halves of a head one after the
    other. Works head by head, so it commutes with slicing rows at head boundaries.
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFTensor(NamedTuple):
    """One tensor of a GGUF file, as `gguf.ReaderTensor` describes it (the fields `GGUFWeight`
    reads), rebuilt from the file's cached tensor table without running gguf's parser."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # dimensions fastest-first, as GGUF lists them
    data: np.ndarray  # a view of the memory-mapped file: float values, or each row's quantized bytes


def gguf_tensors(path: Path, table: list, byte_order: str = "I") -> list[GGUFTensor]:
    """The tensors of the GGUF file at `path` from its tensor table (`gguf_metadata`'s
    `tensors`: name, ggml type, dimensions, absolute byte offset). Nothing is read yet."""
    import gguf

    plain = {
        gguf.GGMLQuantizationType.F32: np.float32,
        gguf.GGMLQuantizationType.F16: np.float16,
        gguf.GGMLQuantizationType.F64: np.float64,
        gguf.GGMLQuantizationType.I8: np.int8,
        gguf.GGMLQuantizationType.I16: np.int16,
        gguf.GGMLQuantizationType.I32: np.int32,
        gguf.GGMLQuantizationType.I64: np.int64,
    }
    mapped = np.memmap(path, mode="r")
    tensors = []
    for name, type_id, dims, offset in table:
        ggml_type = gguf.GGMLQuantizationType(type_id)
        shape = tuple(reversed(dims))  # numpy order
        if ggml_type in plain:
            dtype = np.dtype(plain[ggml_type]).newbyteorder(byte_order)
        else:
            dtype = np.dtype(np.uint8)
            shape = gguf.quants.quant_shape_to_byte_shape(shape, ggml_type)
        count = int(np.prod(shape))
        if offset + count * dtype.itemsize > mapped.size:
            raise ValueError(f"{path.name}: tensor {name!r} runs past the end of the file (truncated?)")
        data = np.ndarray(shape, dtype=dtype, buffer=mapped, offset=offset)
        tensors.append(GGUFTensor(name, ggml_type, tuple(dims), data))
    return tensors


class GGUFBlocks(NamedTuple):
    """Rows of a GGUF tensor's quantized blocks as the file stores them (to be packed)."""

    qtype: str  # a key of gguf_kernels.GGUF_TYPES
    raw: torch.Tensor  # uint8 [rows, bytes per row] ([experts, rows, bytes per row] for stacked experts)
    in_features: int


class GGUFWeight:
    """One tensor of a GGUF file. Rows are sliced before dequantizing (rows are quantized
    independently); columns after. With `native`, the loader wants weights in the form the
    kernels compute with (a float32 model on a CPU): `load_native` offers them."""

    def __init__(
        self,
        tensor,  # a GGUFTensor or gguf.ReaderTensor
        rotary_head_dim: int | None = None,
        ranges: tuple[range, ...] | None = None,
        native: bool = False,
    ) -> None:
        self.tensor = tensor
        # GGUF lists dimensions fastest-first; torch's order is the reverse.
        full_shape = tuple(int(n) for n in reversed(list(tensor.shape)))
        self.ranges = ranges if ranges is not None else tuple(range(n) for n in full_shape)
        self.shape = tuple(len(r) for r in self.ranges)
        self.rotary_head_dim = rotary_head_dim
        self.native = native

    def narrow(self, dim: int, start: int, length: int) -> "GGUFWeight":
        ranges = _narrowed_ranges(self.shape, self.ranges, dim, start, length)
        return GGUFWeight(self.tensor, self.rotary_head_dim, ranges, self.native)

    def load_native(self):
        """This slice as the kernels read it, when the loader wants that (`native`): a
        `GGUFBlocks` for a type with a kernel (columns cut at block boundaries), or, 2-D only, a
        16-bit tensor for F16/BF16; else None (then `load` dequantizes it). A 3-D slice (stacked
        experts) gives raw blocks [experts, rows, bytes per row]."""
        if not self.native or len(self.ranges) not in (2, 3):
            return None
        qtype = self.tensor.tensor_type.name
        if len(self.ranges) == 3:
            experts, rows, cols = self.ranges
            columns = self._block_columns(qtype, cols)
            if columns is None:
                return None
            data = self.tensor.data[experts.start : experts.stop, rows.start : rows.stop, columns]
            return GGUFBlocks(qtype, torch.from_numpy(np.array(data)), len(cols))  # a copy, off the memory map
        rows, cols = self.ranges
        if qtype in ("F16", "BF16"):
            raw = self.tensor.data[rows.start : rows.stop]
            if qtype == "BF16":  # stored as bytes: two per value
                part = raw[:, 2 * cols.start : 2 * cols.stop]
                data = torch.from_numpy(np.array(part)).view(torch.bfloat16)
            else:
                data = torch.from_numpy(np.array(raw[:, cols.start : cols.stop]))
            return self._unpermuted(data, len(rows))
        columns = self._block_columns(qtype, cols)
        if columns is None:
            return None
        data = self.tensor.data[rows.start : rows.stop, columns]
        raw = self._unpermuted(torch.from_numpy(np.array(data)), len(rows))  # a copy, off the memory map
        return GGUFBlocks(qtype, raw, len(cols))

    @staticmethod
    def _block_columns(qtype: str, cols: range) -> slice | None:
        """The bytes of each row that hold columns `cols`, or None (no kernel for the type, or
        the columns cut a block)."""
        from pagedllm.kernels import gguf as gguf_kernels

        if qtype not in gguf_kernels.GGUF_TYPES:
            return None
        block, block_bytes = gguf_kernels.GGUF_TYPES[qtype]
        if cols.start % block or len(cols) % block:
            return None
        return slice(cols.start // block * block_bytes, cols.stop // block * block_bytes)

    def _unpermuted(self, data: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Whole rows (quantized ones too: rows are independent) back in Hugging Face's order."""
        if self.rotary_head_dim is None:
            return data
        if self.ranges[0].start % self.rotary_head_dim or num_rows % self.rotary_head_dim:
            raise ValueError("a rotary projection can only be sliced at head boundaries")
        plain = data.view(torch.int16) if data.dtype == torch.bfloat16 else data  # numpy has no bfloat16
        rows = unpermute_rotary_rows(plain.numpy(), num_rows // self.rotary_head_dim)
        return torch.from_numpy(np.ascontiguousarray(rows)).view(data.dtype)

    def load(self) -> torch.Tensor:
        import gguf

        rows = self.ranges[0]
        raw = self.tensor.data
        if len(self.ranges) == 3:  # stacked experts, dequantized (where `load_native` did not serve them)
            experts, rows, cols = self.ranges
            part = raw[experts.start : experts.stop, rows.start : rows.stop]
            if self.tensor.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                part = gguf.quants.dequantize(part, self.tensor.tensor_type)
            data = part[..., cols.start : cols.stop]
        elif len(self.ranges) == 1:
            data = raw[rows.start : rows.stop]
            if self.tensor.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                data = gguf.quants.dequantize(data, self.tensor.tensor_type)
        else:
            part = raw[rows.start : rows.stop]
            if self.tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                data = part
            else:
                data = gguf.quants.dequantize(part, self.tensor.tensor_type)
            cols = self.ranges[1]
            if cols.start != 0 or cols.stop != data.shape[1]:
                data = data[:, cols.start : cols.stop]
            if self.rotary_head_dim is not None:
                if rows.start % self.rotary_head_dim or len(rows) % self.rotary_head_dim:
                    raise ValueError("a rotary projection can only be sliced at head boundaries")
                data = unpermute_rotary_rows(data, len(rows) // self.rotary_head_dim)
        if data.dtype != np.float32 or np.may_share_memory(data, raw) or not data.flags.writeable:
            data = np.array(data, dtype=np.float32)  # a writable copy, off the memory map
        return torch.from_numpy(data)  # dequantized: already a fresh array of its own


class ShiftedWeight:
    """Another lazy weight plus a constant: a tensor stored transformed (llama.cpp stores
    Gemma's norm weights as 1 + w) read back as the checkpoint holds it."""

    def __init__(self, weight: LazyWeight, shift: float) -> None:
        self.weight = weight
        self.shift = shift
        self.shape = weight.shape

    def narrow(self, dim: int, start: int, length: int) -> "ShiftedWeight":
        return ShiftedWeight(self.weight.narrow(dim, start, length), self.shift)

    def load(self) -> torch.Tensor:
        return self.weight.load() + self.shift
