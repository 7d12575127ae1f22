"""How a mixture's experts (`moe.Experts`) are stored and multiplied: one method object per form,
as the linear layers' (this package) have. `FloatExperts`: float stacks; `GGUFExperts`: each
expert's GGUF blocks as the kernels read them, a `GGUFLinear` per expert over views of two flat
uint8 parameters. They are not linear layers' methods, so the passes over those (oneDNN packing,
the fused decoder, batch-invariant mode) leave them alone; int8 activations take a GGUF expert's
`GGUFLinear` as any other (`layers._int8_methods`), as llama.cpp multiplies its experts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.quant.gguf import GGUFLinear, packed
from pagedllm.model.quant.selection import from_cache
from pagedllm.model.weights import GGUFBlocks


class ExpertsMethod:
    """How a mixture's experts are stored and multiplied (`moe.Experts`): each expert's gate and
    up rows in one product, then its down product. The layer holds the storage in
    `gate_up_proj` and `down_proj`."""

    def gate_up(self, layer: nn.Module, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [rows, H] -> [rows, 2 I]: expert `expert`'s gate outputs, then its up outputs."""
        raise NotImplementedError

    def down(self, layer: nn.Module, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [rows, I] -> [rows, H]."""
        raise NotImplementedError

    @property
    def cache_description(self) -> dict | None:
        """What the weight cache stores to rebuild this method over the saved weights (None: float)."""
        return None

    def bind(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Point the method at its storage (the two parameters' data), once installed."""


class FloatExperts(ExpertsMethod):
    """Float stacks: gate_up_proj [E, 2 I, H] ([gate | up] rows per expert), down_proj [E, H, I]."""

    def gate_up(self, layer, expert, x):
        return F.linear(x, layer.gate_up_proj[expert])

    def down(self, layer, expert, x):
        return F.linear(x, layer.down_proj[expert])


@dataclass(eq=False)
class GGUFExperts(ExpertsMethod):
    """Each expert's GGUF blocks as the kernels read them (a `GGUFLinear` per expert for gate and
    up, one for down). gate_up_proj and down_proj are flat uint8 parameters holding the experts'
    bytes one expert after another (for gate_up: the expert's gate rows, then its up rows); the
    methods' packed weights are views of them. No float copy exists."""

    gate_ups: list  # [GGUFLinear], one per expert
    downs: list  # [GGUFLinear]

    def gate_up(self, layer, expert, x):
        return self.gate_ups[expert].apply(layer, x)

    def down(self, layer, expert, x):
        return self.downs[expert].apply(layer, x)

    @property
    def cache_description(self) -> dict:
        # Every expert of a stack has the same types and shapes (a GGUF tensor has one type).
        return {"method": "gguf_experts", "num_experts": len(self.downs),
                "gate_up": self.gate_ups[0].cache_description, "down": self.downs[0].cache_description}

    def bind(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Point each expert's parts at its bytes inside the flat parameters."""
        for methods, flat in ((self.gate_ups, gate_up), (self.downs, down)):
            size = sum(p.data.numel() for p in methods[0].parts)
            for e, method in enumerate(methods):
                method.bind(flat[e * size : (e + 1) * size])


def gguf_experts(gate: GGUFBlocks, up: GGUFBlocks, down: GGUFBlocks) -> tuple[GGUFExperts, torch.Tensor, torch.Tensor]:
    """The method and its two flat parameters' bytes from the stacks' raw blocks
    ([E, rows, bytes per row] each), each expert packed as its kernels read it."""
    num_experts = down.raw.shape[0]
    method = GGUFExperts(
        [GGUFLinear(packed([GGUFBlocks(gate.qtype, gate.raw[e], gate.in_features),
                             GGUFBlocks(up.qtype, up.raw[e], up.in_features)])) for e in range(num_experts)],
        [GGUFLinear(packed([GGUFBlocks(down.qtype, down.raw[e], down.in_features)])) for e in range(num_experts)])
    gate_up, down_bytes = (torch.cat([p.data.reshape(-1) for m in methods for p in m.parts])
                           for methods in (method.gate_ups, method.downs))
    method.bind(gate_up, down_bytes)
    return method, gate_up, down_bytes


def experts_from_cache(description: dict) -> GGUFExperts:
    """The experts' method the weight cache described (`cache_description`); `bind` it to the
    saved bytes."""
    if description.get("method") != "gguf_experts":
        raise ValueError(f"unknown experts method {description.get('method')!r} in the weight cache")
    templates = [from_cache(description[key]) for key in ("gate_up", "down")]
    gate_ups, downs = ([GGUFLinear(list(t.parts)) for _ in range(description["num_experts"])] for t in templates)
    return GGUFExperts(gate_ups, downs)
