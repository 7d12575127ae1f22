"""The gated MLP of Llama-shaped decoders: down(act(gate(x)) * up(x)), gate and up fused into one
column-parallel product and down row-parallel (its partial sums all-reduced)."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed import TensorParallelGroup
from pagedllm.kernels import ops as fused_ops
from pagedllm.model.activations import activation
from pagedllm.model.layers import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool,
                 tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], bias, tp, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp, dtype)
        self.hidden_act = hidden_act
        self.act = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size / tp], [gate | up]
        if fused_ops.has_gated_kernel(self.hidden_act, gate_up):
            return self.down_proj(fused_ops.gated_activation(gate_up, self.hidden_act))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
