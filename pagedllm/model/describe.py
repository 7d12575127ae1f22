"""What a loaded model is, said in words for the start-up summary (`engine/startup_summary.py`):
the forms its weights take, and which path the CPU kernels run on this machine."""

from __future__ import annotations

from torch import nn

from pagedllm.kernels import build, gguf
from pagedllm.model.quant import GGUFLinear, method_layers
from pagedllm.model.quant.experts import GGUFExperts


def kernels_path(device_type: str) -> str:
    """Which path the CPU kernels take on this machine (`kernels.gguf.ISA_NAMES`), without
    building them where nothing loaded them (a GPU, or the plain torch paths)."""
    if device_type != "cpu":
        return f"none on {device_type}"
    if not build.load.cache_info().currsize:  # never loaded: the plain torch paths serve
        return "not loaded (plain torch)"
    return gguf.ISA_NAMES[gguf.isa()]


def weight_forms(model: nn.Module) -> str:
    """The forms of the projections' (and experts') weights by share of their bytes: "GGUF Q4_K
    80%, Q6_K 20%", or the one float dtype of an unquantized model ("float32")."""
    sizes: dict[str, int] = {}
    blocks: set[str] = set()  # the GGUF block types among them

    def count(method, weights) -> None:
        if isinstance(method, GGUFLinear):
            for part in method.parts:
                sizes[part.qtype] = sizes.get(part.qtype, 0) + part.nbytes
                blocks.add(part.qtype)
            return
        for w in weights:
            form = str(w.dtype).removeprefix("torch.")
            sizes[form] = sizes.get(form, 0) + w.numel() * w.element_size()

    for layer in {id(m.quant_method): m for m in method_layers(model).values()}.values():  # a tied table once
        count(layer.quant_method, [layer.weight])
    for module in model.modules():
        experts = getattr(module, "experts_method", None)
        if isinstance(experts, GGUFExperts):
            for method in experts.gate_ups + experts.downs:
                count(method, [])
        elif experts is not None:  # float stacks
            count(experts, [module.gate_up_proj, module.down_proj])
    total = sum(sizes.values())
    if not total:
        return "none"
    if len(sizes) == 1 and not blocks:
        return next(iter(sizes))
    shares = ", ".join(f"{form} {100 * n / total:.0f}%" for form, n in sorted(sizes.items(), key=lambda kv: -kv[1]))
    return f"GGUF {shares}" if blocks else shares
