"""`GGUFLinear`: the GGUF blocks as the kernels read them, about the file's bytes, no float copy.

The parameter holds them as one flat uint8 tensor (so the weight cache saves them as they are);
products by the kernels' `matmul`, the embedding by dequantizing only the looked-up rows. A fused
weight whose parts are of different types (Q4_K_M's q/k in Q4_K, v in Q6_K) keeps one packed
weight per part. Products of up to `int8_rows` rows run on int8-quantized activations
(`layers.use_int8_activations`, where the trial of model/quant/int8_trial.py finds them faster).

Every type is multiplied by kernels/gguf.py's kernels, from the file's blocks as they are:
Q4_1 and Q8_0 included, which an older pair of kernels (kernels/quant.py, over an unpacked copy
at 1.2x Q4_1's bytes) served until 2026-12-05, when the GGUF kernels measured no slower on the
embedded model end to end (docs/performance-cpu.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from pagedllm.kernels import gguf as gguf_kernels
from pagedllm.model.quant.base import LinearMethod
from pagedllm.model.weights import GGUFBlocks

# GGUFLinear.int8_rows of a weight on int8 activations at every size (prompts too): what the
# trial gives where int8 wins at its largest size (model/quant/int8_trial.py; AMX-INT8 tiles).
EVERY_SIZE = 2**31 - 1


@dataclass(eq=False)
class GGUFLinear(LinearMethod):
    """GGUF blocks as the kernels read them; parts stacked by output rows."""


    parts: list[gguf_kernels.PackedWeight]
    int8_rows: int = 0  # products of up to this many rows on int8 activations (use_int8_activations)
    # (x, part, int8_rows, the kept greedy call) of the last greedy `sample` (see there)
    _greedy: tuple | None = field(default=None, init=False, repr=False)

    @property
    def qtypes(self) -> list[str]:
        return [p.qtype for p in self.parts]

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    def logical_shape(self, layer):
        return self.out_features, self.in_features

    def apply(self, layer, x, bias=None):
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise TypeError(f"GGUF-packed weights multiply float32 CPU activations, not {x.dtype} on {x.device}")
        int8 = x.shape[0] <= self.int8_rows
        ys = [gguf_kernels.matmul(x, p, int8=int8) for p in self.parts]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return y + bias if bias is not None else y

    def samples_in_product(self, layer, x):
        return (len(self.parts) == 1 and self.out_features == layer.vocab_size and x.dtype == torch.float32
                and x.device.type == "cpu")

    def sample(self, layer, x, draws):
        # Greedy rows: the call kept for the last x where this is it (a decode step's hidden states
        # are the same buffer each step, `FusedDecoderLayers.run_steady`): no torch call then.
        kept = self._greedy
        if (draws is None and kept is not None and kept[0] is x and kept[1] is self.parts[0]
                and kept[2] == self.int8_rows):
            return kept[3]()
        int8 = x.shape[0] <= self.int8_rows
        if draws is None and x.shape[0] and x.is_contiguous():
            self._greedy = (x, self.parts[0], self.int8_rows, gguf_kernels.greedy_sampler(x, self.parts[0], int8))
            return self._greedy[3]()
        _, token_ids, logprobs = gguf_kernels.matmul_sample(x, self.parts[0], int8, draws, logits=False)
        return token_ids, logprobs

    def embed(self, layer, ids):
        (table,) = self.parts
        rows = gguf_kernels.dequantize_rows(table, ids)
        return rows if ids.dim() == 1 else rows.view(*ids.shape, self.in_features)

    def to_float(self, layer):
        return torch.cat([gguf_kernels.dequantize_rows(p) for p in self.parts])

    @property
    def supports_int8(self) -> bool:
        return True

    @property
    def fused_parts(self) -> list | None:
        if len(self.parts) > 3 or any(p.qtype not in gguf_kernels.TYPE_IDS for p in self.parts):  # (kMaxParts)
            return None
        return self.parts

    @property
    def cache_description(self) -> dict:
        return {"method": "gguf", "parts": [
            {"qtype": p.qtype, "out_features": p.out_features, "in_features": p.in_features, "shape": list(p.data.shape), "nbytes": p.data.numel()} for p in self.parts]}

    def bind(self, storage: torch.Tensor) -> None:
        """Point the parts at their bytes inside `storage` (the flat parameter's data)."""
        offset, parts = 0, []
        for p in self.parts:
            n = p.data.numel()
            data = storage[offset : offset + n].view(p.data.shape)
            parts.append(gguf_kernels.from_data(p.qtype, p.out_features, p.in_features, data))
            offset += n
        self.parts = parts


def flat_parameter(parts: list) -> nn.Parameter:
    """One uint8 parameter holding every part's packed bytes, back to back."""
    data = parts[0].data.reshape(-1) if len(parts) == 1 else torch.cat([p.data.reshape(-1) for p in parts])
    return nn.Parameter(data.view(torch.uint8), requires_grad=False)


def packed(blocks: list[GGUFBlocks]) -> list:
    """Packed weights of the parts, adjacent parts of one type packed together (a fused
    projection of one type is one product)."""
    groups: list[list[GGUFBlocks]] = []
    for b in blocks:
        if groups and groups[-1][0].qtype == b.qtype:
            groups[-1].append(b)
        else:
            groups.append([b])
    return [gguf_kernels.pack(g[0].qtype, g[0].raw if len(g) == 1 else torch.cat([b.raw for b in g]),
                                                 g[0].in_features)
            for g in groups]


def gguf_from_cache(description: dict) -> GGUFLinear:
    """The GGUF method the weight cache described, over zeroed bytes until `bind`."""
    return GGUFLinear([gguf_kernels.from_data(p["qtype"], p["out_features"], p["in_features"],
                                              torch.zeros(p["nbytes"], dtype=torch.uint8).view(p["shape"]))
                       for p in description["parts"]])
