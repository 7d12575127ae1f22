"""Fused float32 CPU operators of the decoder layer (csrc/cpu_ops.cpp): RMSNorm with the
residual add, rotary embedding in place, and SiLU-and-multiply. Each replaces several torch
operators; `applies` says when a tensor can take them (float32, CPU, the kernels built)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _lib():
    from pagedllm.kernels import build

    return build.load() if build.available() else None


def applies(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and _lib() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * r / rms(r) with r = x, or r = residual + x written into `residual` (in place)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    rows, dim = x.shape
    if residual is not None:
        assert residual.is_contiguous() and residual.shape == x.shape
    _lib().fused_add_rms_norm_f32(
        out.data_ptr(), residual.data_ptr() if residual is not None else None, x.data_ptr(),
        weight.data_ptr(), rows, dim, eps, torch.get_num_threads(),
    )
    return out


def rotary_(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
    """Rotate in place the heads at the front of each row of `qk` (rows may be strided)."""
    assert qk.stride(1) == 1 and positions.dtype == torch.int64 and cos.is_contiguous() and sin.is_contiguous()
    positions = positions.contiguous()
    _lib().rotary_neox_f32(
        qk.data_ptr(), qk.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        qk.shape[0], qk.shape[1] // head_dim, head_dim, torch.get_num_threads(),
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, 2 d] laid out [gate | up] -> silu(gate) * up: [rows, d]."""
    x = x.contiguous()
    rows, width = x.shape
    out = torch.empty(rows, width // 2, dtype=x.dtype)
    _lib().silu_and_mul_f32(out.data_ptr(), x.data_ptr(), rows, width // 2, torch.get_num_threads())
    return out
