"""Fused CPU operators: of the decoder layer, in float32 and bfloat16 (csrc/cpu_ops.cpp: RMSNorm
with the residual add, rotary embedding in place, SiLU-and-multiply) and of sampling, in float32
(csrc/sampling.cpp: row log-sum-exp, drawing from softmax(logits / T)). Each replaces several
torch operators; `applies` says when a tensor can take the sampling ones, `applies_to_layer`
the decoder layer's (the dtype, a CPU tensor, the kernels built)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _lib():
    from pagedllm.kernels import build

    return build.load() if build.available() else None


def applies(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and _lib() is not None


_LAYER_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def applies_to_layer(x: torch.Tensor) -> bool:
    return x.dtype in _LAYER_SUFFIX and x.device.type == "cpu" and _lib() is not None


def entry(name: str):
    """The kernel library's C function `name`, or None where the library is not built."""
    lib = _lib()
    return getattr(lib, name) if lib is not None else None


def as_kernel_array(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` as a contiguous array of `dtype` for a kernel: itself where it already is one (a
    decode step's inputs are, and are advanced in place), with no call into torch then: a step
    that has just streamed the weights through the caches fetches each such call's code again,
    tens of microseconds for what costs one warm."""
    return tensor if tensor.dtype == dtype and tensor.is_contiguous() else tensor.to(dtype).contiguous()


def _kernel(name: str, x: torch.Tensor):
    return _kernel_for(name, x.dtype)


@functools.cache
def _kernel_for(name: str, dtype: torch.dtype):
    return getattr(_lib(), f"{name}_{_LAYER_SUFFIX[dtype]}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * r / rms(r) with r = x, or r = residual + x written into `residual` (in place).
    x, weight and residual share one dtype."""
    x = x.contiguous()
    out = torch.empty_like(x)
    rows, dim = x.shape
    assert weight.dtype == x.dtype and weight.is_contiguous()
    if residual is not None:
        assert residual.is_contiguous() and residual.shape == x.shape and residual.dtype == x.dtype
    _kernel("fused_add_rms_norm", x)(
        out.data_ptr(), residual.data_ptr() if residual is not None else None, x.data_ptr(),
        weight.data_ptr(), rows, dim, eps, torch.get_num_threads(),
    )
    return out


def rotary_(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
    """Rotate in place the heads at the front of each row of `qk` (rows may be strided), the
    first cos.shape[1] dimensions of each (a partial rotary turns fewer than head_dim); cos and
    sin in qk's dtype."""
    assert qk.stride(1) == 1 and positions.dtype == torch.int64 and cos.is_contiguous() and sin.is_contiguous()
    assert cos.dtype == sin.dtype == qk.dtype
    positions = positions.contiguous()
    _kernel("rotary_neox", qk)(
        qk.data_ptr(), qk.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        qk.shape[0], qk.shape[1] // head_dim, head_dim, cos.shape[1], torch.get_num_threads(),
    )


# transformers' activation names -> the gated kernel computing act(gate) * up, and the dtypes it
# serves (GELU's tanh form in float32 only: its bfloat16 rounding would not be transformers').
GATED_KERNELS = {"silu": ("silu_and_mul", (torch.float32, torch.bfloat16)),
                 "swish": ("silu_and_mul", (torch.float32, torch.bfloat16)),
                 "gelu_pytorch_tanh": ("gelu_tanh_and_mul", (torch.float32,)),
                 "gelu_new": ("gelu_tanh_and_mul", (torch.float32,))}


def has_gated_kernel(activation: str, x: torch.Tensor) -> bool:
    """Whether `gated_activation(x, activation)` serves x (the kernels built, a CPU tensor)."""
    kernel = GATED_KERNELS.get(activation)
    return kernel is not None and x.dtype in kernel[1] and applies_to_layer(x)


def gated_activation(x: torch.Tensor, activation: str) -> torch.Tensor:
    """x: [rows, 2 d] laid out [gate | up] -> act(gate) * up: [rows, d] (`has_gated_kernel`)."""
    x = x.contiguous()
    rows, width = x.shape
    out = torch.empty(rows, width // 2, dtype=x.dtype)
    _kernel(GATED_KERNELS[activation][0], x)(out.data_ptr(), x.data_ptr(), rows, width // 2, torch.get_num_threads())
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, 2 d] laid out [gate | up] -> silu(gate) * up: [rows, d]."""
    return gated_activation(x, "silu")


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(1) == 1 else x.contiguous()


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, n] -> log sum_j exp(x[:, j]): [rows, 1]."""
    return _logsumexp(x, None)


def logsumexp_and_argmax_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [rows, n] -> (logsumexp_rows(x), x.argmax(dim=-1)) with each row read from memory once
    (the greedy token and its normaliser); torch's argmax on rows holding NaN too."""
    argmax = torch.empty(x.shape[0], dtype=torch.int64)
    return _logsumexp(x, argmax), argmax


def greedy_rows(x: torch.Tensor) -> tuple[list[int], list[float]]:
    """x: [rows, n] -> each row's greedy token x.argmax(dim=-1) and its log-probability
    x[argmax] - logsumexp(x) (bitwise what `logsumexp_and_argmax_rows` then a gather and a
    subtraction give), in one call: a decode step's sampling at a handful of greedy sequences."""
    argmax = torch.empty(x.shape[0], dtype=torch.int64)
    logprob = torch.empty(x.shape[0], dtype=torch.float32)
    _logsumexp(x, argmax, logprob)
    return argmax.tolist(), logprob.tolist()


def _logsumexp(x: torch.Tensor, argmax: torch.Tensor | None, logprob: torch.Tensor | None = None) -> torch.Tensor:
    x = _rows(x)
    out = torch.empty(x.shape[0], 1, dtype=torch.float32)
    _lib().logsumexp_rows_f32(
        out.data_ptr(), argmax.data_ptr() if argmax is not None else None,
        logprob.data_ptr() if logprob is not None else None, x.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
        torch.get_num_threads(),
    )
    return out


def sample_filtered_rows(
    x: torch.Tensor, temperature: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float],
    uniform: torch.Tensor,
) -> torch.Tensor:
    """One draw per row from softmax(x / temperature) restricted by the row's top-k (0: none),
    top-p (1.0: none) and min-p (0.0: none), as the sampling package's `filter_top_k_top_p_min_p`
    then `sample_rows` give, without sorting the vocabulary (csrc/sampling_filtered.cpp).
    x: [rows, n]; temperature, uniform: [rows] -> token ids [rows] (int64)."""
    x = _rows(x)
    temperature = temperature.to(torch.float32).contiguous()
    uniform = uniform.to(torch.float32).contiguous()
    k = torch.tensor(top_k, dtype=torch.int64)
    p, m = torch.tensor(top_p, dtype=torch.float32), torch.tensor(min_p, dtype=torch.float32)
    tokens = torch.empty(x.shape[0], dtype=torch.int64)
    _lib().sample_filtered_rows_f32(
        tokens.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), temperature.data_ptr(), k.data_ptr(),
        p.data_ptr(), m.data_ptr(), uniform.data_ptr(), torch.get_num_threads(),
    )
    return tokens


def top_logprobs_rows(
    x: torch.Tensor, log_norm: torch.Tensor, chosen: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's k largest log-probabilities x - log_norm with their token ids (from the largest;
    ties: the lower id first; -inf / -1 past a row shorter than k) and the rank of the token
    `chosen` (1 + the tokens of larger log-probability), in one pass of the row.
    x: [rows, n]; log_norm: [rows] or [rows, 1]; chosen: [rows] -> ([rows, k], [rows, k], [rows])."""
    x = _rows(x)
    rows = x.shape[0]
    log_norm = log_norm.reshape(rows).to(torch.float32).contiguous()
    chosen = chosen.reshape(rows).to(torch.int64).contiguous()
    values, ids = torch.empty(rows, k, dtype=torch.float32), torch.empty(rows, k, dtype=torch.int64)
    ranks = torch.empty(rows, dtype=torch.int64)
    _lib().top_logprobs_rows_f32(values.data_ptr(), ids.data_ptr(), ranks.data_ptr(), x.data_ptr(), rows, x.shape[1],
                                 x.stride(0), log_norm.data_ptr(), chosen.data_ptr(), k, torch.get_num_threads())
    return values, ids, ranks


def sample_rows(x: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One draw per row from softmax(x / temperature) by inverting its cumulative distribution
    at `uniform` (in [0, 1)): the first token whose cumulative probability exceeds it.
    x: [rows, n]; temperature, uniform: [rows] -> token ids [rows] (int64)."""
    x = _rows(x)
    inv_t = (1.0 / temperature.to(torch.float32)).contiguous()
    uniform = uniform.to(torch.float32).contiguous()
    tokens = torch.empty(x.shape[0], dtype=torch.int64)
    _lib().sample_rows_f32(
        tokens.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), inv_t.data_ptr(), uniform.data_ptr(),
        torch.get_num_threads(),
    )
    return tokens
