"""How a layer's weight is stored and multiplied: one method object per form (vLLM's
`quant_method`), so the layers, the weight cache, the fused decoder and batch-invariant mode
ask the method instead of branching on GGUF type names.

A method is chosen when the layer's weight has arrived (`assemble`): the checkpoint offers each
part of the weight in its native form where the model can compute with it (`load_native` of a
GGUF tensor: a float32 model on a CPU), else as float. Then:
- `FloatLinear`: the weight is a float tensor in the model's dtype; products through oneDNN's
  packed copy (`process_weights_after_loading`, on a CPU) or `F.linear`.
- `GGUFLinear`: the weight is the GGUF blocks as the kernels read them
  (`pagedllm.kernels.gguf.PackedWeight`, about the file's bytes; the parameter holds them as one
  flat uint8 tensor, so the weight cache saves them as they are); products by `gguf.matmul`,
  the embedding by dequantizing only the looked-up rows. A fused weight whose parts are of
  different types (Q4_K_M's q/k in Q4_K, v in Q6_K) keeps one packed weight per part. No float
  copy exists.
- `HalfLinear`: an F16 or BF16 GGUF weight kept 16-bit in a float32 model; each product widens
  the weight in slices of rows (exact: 16-bit values are float32 values).

Properties of a method: `batch_invariant` (a row's product is the same whatever rows share it;
`invariance.make_batch_invariant` turns the others into `FloatLinear`), `int8_rows` (GGUF
only: products of up to that many rows run on int8 activations), `fused_parts` (what the C++
decoder loop reads, `fused_layers`), and `cache_description` (how the weight cache rebuilds it).

Paths that dequantize at load (a float copy, no GGUF blocks): bfloat16/float16 models, GPUs,
tensor-parallel shards whose columns do not fall on block boundaries, stacked MoE experts whose
three stacks are not all of native types, and batch-invariant mode (`to_float`).

Experts (`moe.Experts`) have their own methods (model/expert_methods.py: `FloatExperts`, and
`GGUFExperts`, a `GGUFLinear` per expert over views of two flat uint8 parameters); they are not
among `method_layers`, so the dense passes (oneDNN packing, int8 activations, the fused decoder,
batch-invariant mode) leave them alone.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import gguf as gguf_kernels
from pagedllm.kernels import onednn, quant
from pagedllm.model.weights import GGUFBlocks

logger = logging.getLogger("pagedllm")

# Rows of a 16-bit weight widened to float32 at a time (a transient of ~4 MiB at 1024 columns).
_HALF_ROWS = 1024
# Which kernels multiply each GGUF type: kernels/quant.py's for Q4_1 and Q8_0 while they are
# faster there (its docstring has the figures; PAGEDLLM_GGUF_LEGACY_KERNELS=0 turns that off),
# kernels/gguf.py's for every type.
KERNELS = {"gguf": gguf_kernels, "quant": quant}
LEGACY_TYPES = () if os.environ.get("PAGEDLLM_GGUF_LEGACY_KERNELS") == "0" else tuple(quant.TYPE_IDS)


def kernels_for(qtype: str) -> str:
    """The name (a key of KERNELS) of the kernels that serve `qtype`."""
    return "quant" if qtype in LEGACY_TYPES else "gguf"


def kernels_of(part):
    """The kernels module (kernels/quant.py or kernels/gguf.py) that reads this packed part's layout."""
    return quant if isinstance(part, quant.LegacyPacked) else gguf_kernels


def c_kernel(part) -> tuple[int, bool]:
    """(the C ABI's qtype id, whether kernels/quant.py's entry point serves it) of a packed part."""
    legacy = isinstance(part, quant.LegacyPacked)
    return (quant if legacy else gguf_kernels).TYPE_IDS[part.qtype], legacy


class LinearMethod:
    """The interface; see the module's docstring."""

    batch_invariant = False
    int8_rows = 0

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] -> x W^T + b [rows, out] (`layer.weight` holds the weight's storage)."""
        raise NotImplementedError

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight (an embedding lookup) in the model's dtype."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Lay the weight out for its kernel once it is loaded and placed."""

    def to_float(self, layer: nn.Module) -> torch.Tensor:
        """The weight dequantized: a float32 [out, in] tensor."""
        raise NotImplementedError

    @property
    def supports_int8(self) -> bool:
        return False

    @property
    def fused_parts(self) -> list | None:
        """The packed parts the C++ decoder loop multiplies by (`gguf_matmul`), or None where it cannot."""
        return None

    @property
    def cache_description(self) -> dict | None:
        """What the weight cache stores to rebuild this method over the saved weight (None: a float weight)."""
        return None

    def extra_tensors(self) -> list[torch.Tensor]:
        """Tensors the method holds besides `layer.weight` (for the memory report)."""
        return []

    def extra_bytes(self) -> int:
        """Bytes of opaque forms (oneDNN's packed copy) that the memory report cannot see as pages."""
        return 0


@dataclass(eq=False)
class FloatLinear(LinearMethod):
    """A float weight; on a CPU, oneDNN's reordered copy serves the products of the weight's own
    dtype (`row_tile`: run every product at that many rows, for batch invariance)."""

    packed: torch.Tensor | None = field(default=None, repr=False)
    row_tile: int | None = None

    @property
    def batch_invariant(self) -> bool:  # checked per shape by invariance.py, which sets row_tile
        return self.packed is not None

    def apply(self, layer, x, bias=None):
        if self.packed is not None and x.dtype == layer.weight.dtype:
            return onednn.packed_linear(x, self.packed, bias, self.row_tile)
        return F.linear(x, layer.weight, bias)

    def embed(self, layer, ids):
        return F.embedding(ids, layer.weight)

    def to_float(self, layer):
        return layer.weight.float()

    def extra_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() if self.packed is not None else 0


@dataclass(eq=False)
class HalfLinear(LinearMethod):
    """An F16/BF16 GGUF weight kept 16-bit in a float32 model."""

    def apply(self, layer, x, bias=None):
        w = layer.weight
        parts = [F.linear(x, w[i : i + _HALF_ROWS].to(x.dtype)) for i in range(0, w.shape[0], _HALF_ROWS)]
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return y + bias if bias is not None else y

    def embed(self, layer, ids):
        return F.embedding(ids, layer.weight).float()

    def to_float(self, layer):
        return layer.weight.float()

    @property
    def cache_description(self) -> dict:
        return {"method": "half"}


@dataclass(eq=False)
class GGUFLinear(LinearMethod):
    """GGUF blocks as the kernels read them; parts stacked by output rows."""

    parts: list  # [gguf_kernels.PackedWeight]
    int8_rows: int = 0  # products of up to this many rows on int8 activations (use_int8_activations)

    @property
    def qtypes(self) -> list[str]:
        return [p.qtype for p in self.parts]

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    def apply(self, layer, x, bias=None):
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise TypeError(f"GGUF-packed weights multiply float32 CPU activations, not {x.dtype} on {x.device}")
        int8 = x.shape[0] <= self.int8_rows
        ys = [kernels_of(p).matmul(x, p, int8=int8) for p in self.parts]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return y + bias if bias is not None else y

    def embed(self, layer, ids):
        (table,) = self.parts
        flat = ids.reshape(-1)
        return kernels_of(table).dequantize_rows(table, flat.long()).view(*ids.shape, self.in_features)

    def to_float(self, layer):
        return torch.cat([kernels_of(p).dequantize_rows(p) for p in self.parts])

    @property
    def supports_int8(self) -> bool:
        return True

    @property
    def fused_parts(self) -> list | None:
        if len(self.parts) > 3 or any(p.qtype not in kernels_of(p).TYPE_IDS for p in self.parts):  # (kMaxParts)
            return None
        return self.parts

    @property
    def cache_description(self) -> dict:
        return {"method": "gguf", "parts": [
            {"qtype": p.qtype, "kernels": "quant" if kernels_of(p) is quant else "gguf", "out_features": p.out_features,
             "in_features": p.in_features, "shape": list(p.data.shape), "nbytes": p.data.numel()} for p in self.parts]}

    def rebind(self, flat: torch.Tensor) -> None:
        """Point the parts at their bytes inside `flat` (the parameter's storage)."""
        offset, parts = 0, []
        for p in self.parts:
            n = p.data.numel()
            data = flat[offset : offset + n].view(p.data.shape)
            parts.append(kernels_of(p).from_data(p.qtype, p.out_features, p.in_features, data))
            offset += n
        self.parts = parts


def _flat_parameter(parts: list) -> nn.Parameter:
    """One uint8 parameter holding every part's packed bytes, back to back."""
    data = parts[0].data.reshape(-1) if len(parts) == 1 else torch.cat([p.data.reshape(-1) for p in parts])
    return nn.Parameter(data.view(torch.uint8), requires_grad=False)


def install(layer: nn.Module, method: LinearMethod, weight: torch.Tensor) -> None:
    """Make `method` the layer's, over `weight` (its storage: float, 16-bit, or packed bytes),
    keeping the parameter's weight loader."""
    old = layer.weight
    param = nn.Parameter(weight, requires_grad=False)
    if hasattr(old, "weight_loader"):
        param.weight_loader = old.weight_loader
    layer.weight = param
    if isinstance(method, GGUFLinear):
        method.rebind(param.data)
    layer.quant_method = method


@dataclass
class _Pending:
    """The parts of a fused weight that have arrived (part index -> lazy weight, row offset)."""

    parts: dict[int, tuple[Any, int]] = field(default_factory=dict)


def load_part(layer: nn.Module, weight, row_offset: int, part: int = 0, num_parts: int = 1) -> None:
    """Receive part `part` of `layer`'s weight (a lazy weight: its rows go at `row_offset`); once
    all `num_parts` have arrived, choose the layer's method and fill it (`assemble`)."""
    if num_parts == 1:
        _assemble(layer, [(weight, row_offset)])
        return
    pending = layer.__dict__.setdefault("_pending_parts", _Pending())
    pending.parts[part] = (weight, row_offset)
    if len(pending.parts) == num_parts:
        del layer.__dict__["_pending_parts"]
        _assemble(layer, [pending.parts[i] for i in range(num_parts)])


def _native(weight):
    return weight.load_native() if hasattr(weight, "load_native") else None


def _packed(blocks: list[GGUFBlocks]) -> list:
    """Packed weights of the parts, adjacent parts of one type packed together (a fused
    projection of one type is one product)."""
    groups: list[list[GGUFBlocks]] = []
    for b in blocks:
        if groups and groups[-1][0].qtype == b.qtype:
            groups[-1].append(b)
        else:
            groups.append([b])
    return [KERNELS[kernels_for(g[0].qtype)].pack(g[0].qtype, g[0].raw if len(g) == 1 else torch.cat([b.raw for b in g]),
                                                 g[0].in_features)
            for g in groups]


def _assemble(layer: nn.Module, parts: list[tuple[Any, int]]) -> None:
    """GGUF blocks when every part has them, one 16-bit tensor when every part is 16-bit of one
    dtype, else float in the model's dtype (parts dequantized)."""
    natives = [_native(w) for w, _ in parts]
    if all(isinstance(n, GGUFBlocks) for n in natives):
        packed = _packed(natives)
        del natives
        install(layer, GGUFLinear(packed), _flat_parameter(packed).data)
        return
    if all(isinstance(n, torch.Tensor) for n in natives) and len({n.dtype for n in natives}) == 1:
        install(layer, HalfLinear(), natives[0] if len(natives) == 1 else torch.cat(natives))
        return
    param = layer.weight
    if param.dtype == torch.uint8 or param.dim() != 2:
        raise RuntimeError("a layer's weight was loaded twice in different forms")
    for (weight, offset), native in zip(parts, natives):
        if isinstance(native, GGUFBlocks):
            value = weight.load()  # dequantized (another part has no kernel)
        elif native is not None:
            value = native
        else:
            value = weight.load()
        target = param.data.narrow(0, offset, value.shape[0])
        if tuple(target.shape) != tuple(value.shape):
            raise ValueError(f"checkpoint tensor of shape {tuple(value.shape)} does not fit parameter {tuple(target.shape)}")
        target.copy_(value)
    layer.quant_method = FloatLinear()


def from_cache(description: dict | None) -> LinearMethod:
    """The method the weight cache described (`cache_description`), before `install`."""
    if description is None:
        return FloatLinear()
    if description["method"] == "half":
        return HalfLinear()
    if description["method"] == "gguf":
        parts = [KERNELS[p["kernels"]].from_data(p["qtype"], p["out_features"], p["in_features"],
                                                 torch.zeros(p["nbytes"], dtype=torch.uint8).view(p["shape"]))
                 for p in description["parts"]]
        return GGUFLinear(parts)
    raise ValueError(f"unknown weight method {description['method']!r} in the weight cache")


def method_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every module that owns a weight through a method, by name (a tied head not again)."""
    return {name: m for name, m in model.named_modules() if "quant_method" in m.__dict__}


# GGUFLinear.int8_rows of a weight on int8 activations at every size (prompts too): what the
# trial gives where int8 wins at its largest size (model/int8_trial.py; AMX-INT8 tiles).
EVERY_SIZE = 2**31 - 1


def layer_of(model: nn.Module, weight: torch.Tensor) -> nn.Module:
    """The layer whose method owns `weight` (a parameter `layer_projections` names)."""
    return next(m for m in method_layers(model).values() if m.weight is weight)


def dense_weight(model: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """`weight` as a float32 [out, in] matrix, whatever its form (dequantized for a packed one)."""
    layer = layer_of(model, weight)
    return layer.quant_method.to_float(layer)


def logical_shape(layer: nn.Module) -> tuple[int, int]:
    """(out_features, in_features) of the layer's weight, whatever its storage."""
    method = layer.quant_method
    if isinstance(method, GGUFLinear):
        return method.out_features, method.in_features
    return tuple(layer.weight.shape)


def use_float(layer: nn.Module) -> None:
    """Replace the layer's method by `FloatLinear` over its dequantized weight (batch-invariant mode)."""
    if isinstance(layer.quant_method, FloatLinear):
        return
    install(layer, FloatLinear(), layer.quant_method.to_float(layer).contiguous())
