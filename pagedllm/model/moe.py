"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE), run as grouped expert products.

Routing: router logits [T, E] -> softmax in float32 -> the top k experts per token, their
probabilities rescaled to sum to 1 where the model says so (`norm_topk_prob`; always in Mixtral).

Experts: the T * k (token, expert) pairs are sorted by expert, so each expert's tokens are one
contiguous block; each expert then runs one gated-MLP product over its whole block (a loop over
the experts that have tokens, never over tokens). The outputs go back to their (token, slot)
places, are weighted by the router, and each token's k outputs are summed in expert order, as
transformers' `index_add_` over experts sums them (the same rounding in 16-bit dtypes).

Tensor parallelism: every rank holds a slice of every expert's intermediate dimension (rows of
gate and up, columns of down), like the dense MLP; a token's partial sums are all-reduced once.
The router is replicated. A GGUF file's experts keep their blocks (`quant.experts.GGUFExperts`)
on a float32 CPU model where the slice of down's columns falls on block boundaries, as a dense
layer's do; else they are dequantized.
"""

from __future__ import annotations

import ctypes
import re

import torch
from torch import nn

from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.activations import activation
from pagedllm.model.layers import ColumnParallelLinear, _copy_into, _new_param
from pagedllm.model.quant.experts import ExpertsMethod, FloatExperts, GGUFExperts, gguf_experts
from pagedllm.model.weights import GGUFBlocks, LazyWeight
from pagedllm.transformers_utils.arch import MoEConfig

# Checkpoint names of an expert's three projections (Qwen3-MoE's, Mixtral's) -> our part names.
EXPERT_PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_ONE_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight")
# Every expert in one 3-D tensor: transformers 5's gate_up_proj [E, 2 I, H] and down_proj
# [E, H, I], or GGUF's gate, up and down stacks (named as our loader names them).
_STACKED = re.compile(r"(.+\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?")


def expert_checkpoint_targets(name: str, weight: LazyWeight) -> list[tuple[str, tuple, LazyWeight]] | None:
    """(our parameter, (part, expert), weight) for a checkpoint tensor of experts, or None when
    `name` is no expert's. One expert's 2-D tensor names its expert; a stacked one has None."""
    if match := _ONE_EXPERT.fullmatch(name):
        prefix, expert, part = match.group(1), int(match.group(2)), EXPERT_PARTS[match.group(3)]
        return [(f"{prefix}.{'down_proj' if part == 'down' else 'gate_up_proj'}", (part, expert), weight)]
    if match := _STACKED.fullmatch(name):
        prefix, kind = match.groups()
        if kind == "gate_up_proj":
            width = weight.shape[1] // 2
            return [(f"{prefix}.gate_up_proj", ("gate", None), weight.narrow(1, 0, width)),
                    (f"{prefix}.gate_up_proj", ("up", None), weight.narrow(1, width, width))]
        part = EXPERT_PARTS[kind]
        return [(f"{prefix}.{'down_proj' if part == 'down' else 'gate_up_proj'}", (part, None), weight)]
    return None


class Experts(nn.Module):
    """Every expert's gated MLP, stacked: gate_up_proj [E, 2 * I / tp, H] ([gate | up] rows per
    expert) and down_proj [E, H, I / tp] in float (`FloatExperts`), or, from a GGUF file whose
    three stacks have kernels, each expert's blocks as the kernels read them (`GGUFExperts`:
    the two parameters become flat uint8 bytes)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str,
                 tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.per_rank = tp.split(intermediate_size, "moe_intermediate_size")
        self.hidden_act = hidden_act
        self.act = activation(hidden_act)
        self.gate_up_proj = _new_param(num_experts, 2 * self.per_rank, hidden_size, dtype=dtype, loader=self.weight_loader)
        self.down_proj = _new_param(num_experts, hidden_size, self.per_rank, dtype=dtype, loader=self.weight_loader)
        self.experts_method: ExpertsMethod = FloatExperts()
        # Stacks that arrived as GGUF blocks, kept until all three have (then packed) or one
        # has not (then every stack is dequantized): part -> (lazy weight, blocks).
        self._pending_blocks: dict[str, tuple[LazyWeight, GGUFBlocks]] = {}
        self._dequantizing = False

    @property
    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        """Each parameter's [out, in] per expert, whatever its storage."""
        return {"gate_up_proj": (2 * self.per_rank, self.hidden_size), "down_proj": (self.hidden_size, self.per_rank)}

    def expected_shards(self, param_name: str) -> set:
        parts = ("down",) if param_name == "down_proj" else ("gate", "up")
        return {(part, e) for part in parts for e in range(self.num_experts)}

    def weight_loader(self, param: nn.Parameter, weight: LazyWeight, shard: tuple[str, int | None]) -> list:
        """Load one part (gate, up or down) of one expert (a 2-D checkpoint tensor), or of every
        expert (`expert` None: a stacked 3-D tensor, as GGUF files hold them). Returns the
        (part, expert) shards it filled."""
        part, expert = shard
        start = self.tp.rank * self.per_rank
        if part == "down":  # this rank's input columns
            piece = weight.narrow(len(weight.shape) - 1, start, self.per_rank)
        else:  # this rank's rows of gate or of up
            piece = weight.narrow(len(weight.shape) - 2, start, self.per_rank)
        filled = [(part, e) for e in (range(self.num_experts) if expert is None else [expert])]
        blocks = piece.load_native() if expert is None and hasattr(piece, "load_native") else None
        if isinstance(blocks, GGUFBlocks) and not self._dequantizing:
            self._pending_blocks[part] = (piece, blocks)
            if len(self._pending_blocks) == 3:
                pending = self._pending_blocks
                self._pending_blocks = {}
                self.install(*gguf_experts(*(pending[p][1] for p in ("gate", "up", "down"))))
            return filled
        self._dequantizing = True  # a stack without blocks: all are float
        for held, (lazy, _) in self._pending_blocks.items():
            self._copy_float(held, None, lazy)
        self._pending_blocks = {}
        self._copy_float(part, expert, piece)
        return filled

    def _copy_float(self, part: str, expert: int | None, piece: LazyWeight) -> None:
        """Dequantize `piece` (this rank's slice of a part, of one expert or of all) into the float stacks."""
        if self.gate_up_proj.dtype == torch.uint8:
            raise RuntimeError("experts were loaded twice in different forms")
        if part == "down":
            target = self.down_proj.data
        else:
            target = self.gate_up_proj.data.narrow(1, 0 if part == "gate" else self.per_rank, self.per_rank)
        _copy_into(target if expert is None else target[expert], piece.load())

    def install(self, method: ExpertsMethod, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Make `method` the experts', over `gate_up` and `down` (its storage), keeping the
        parameters' weight loader."""
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(down, requires_grad=False)
        for param in (self.gate_up_proj, self.down_proj):
            param.weight_loader = self.weight_loader
        method.bind(self.gate_up_proj.data, self.down_proj.data)
        self.experts_method = method

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; expert_ids, weights: [T, k], each row's experts in ascending order ->
        sum_j weights[t, j] * expert_j(x[t]): [T, H], this rank's partial sum."""
        num_tokens, k = expert_ids.shape
        flat = expert_ids.flatten()  # [T * k]
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        grouped = x[order // k]  # [T * k, H]: each pair's token, expert by expert
        out = torch.empty_like(grouped)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            block = grouped[start : start + count]
            gate, up = self.experts_method.gate_up(self, e, block).chunk(2, dim=-1)
            out[start : start + count] = self.experts_method.down(self, e, self.act(gate) * up)
            start += count
        per_slot = torch.empty_like(out)
        per_slot[order] = out
        # Weighted in the router's dtype (float32 for Mixtral), then rounded, then summed over
        # each token's experts in ascending expert order.
        per_slot = (per_slot.view(num_tokens, k, -1) * weights.unsqueeze(-1)).to(x.dtype)
        total = per_slot[:, 0]
        for j in range(1, k):
            total = total + per_slot[:, j]
        return total


class SparseMoE(nn.Module):
    """Router (`gate`) and experts of one MoE layer; see the module's docstring."""

    def __init__(self, hidden_size: int, moe: MoEConfig, hidden_act: str, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.weights_in_float32 = moe.routing_weights_in_float32
        self.gate = ColumnParallelLinear(hidden_size, moe.num_experts, False, TensorParallelGroup(), dtype)  # replicated
        self.experts = Experts(moe.num_experts, hidden_size, moe.intermediate_size, hidden_act, tp, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and self._kernel() is not None:
            return self._forward_kernel(x)
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_in_float32:
            weights = weights.to(x.dtype)
        expert_ids, slots = expert_ids.sort(dim=-1)
        weights = weights.gather(-1, slots)
        return self.tp.all_reduce(self.experts(x, expert_ids, weights))

    def _kernel(self):
        """The C++ mixture (decoder_layers.cpp's `moe_forward`, what the fused decoder step runs)
        where it serves this layer: GGUF-packed experts, a float32 or GGUF-packed router, one
        rank; built again when the storage or the int8 bounds change. None elsewhere (the torch
        path above)."""
        from pagedllm.kernels import ops as fused_ops
        from pagedllm.model.fused_layers import moe_struct, moe_supported

        method = self.experts.experts_method
        int8_rows = [getattr(m, "int8_rows", 0) for m in (self.gate.quant_method, *getattr(method, "gate_ups", ())[:1])]
        key = (self.experts.gate_up_proj.data_ptr(), self.experts.down_proj.data_ptr(), self.gate.weight.data_ptr(),
               *int8_rows)  # (the C++ view reads each product's int8 bound)
        cached = self.__dict__.get("_kernel_struct")
        if cached is None or cached[0] != key:
            if fused_ops._lib() is None or not moe_supported(self):
                self.__dict__["_kernel_struct"] = (key, None)
                return None
            self.__dict__["_kernel_struct"] = cached = (key, moe_struct(self))
        return cached[1]

    def _forward_kernel(self, x: torch.Tensor) -> torch.Tensor:
        from pagedllm.kernels import ops as fused_ops

        struct, _ = self._kernel()
        x = x.contiguous()
        out = torch.empty_like(x)
        fused_ops._lib().moe_layer_f32(out.data_ptr(), x.data_ptr(), ctypes.addressof(struct), x.shape[0], x.shape[1],
                                       torch.get_num_threads())
        return out
