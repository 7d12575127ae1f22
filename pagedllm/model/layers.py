"""Tensor-parallel building blocks (Megatron-style). With a group of size 1 they are plain layers.

Each parameter carries its own `weight_loader(param, lazy_weight, shard_id=None)`: the layer
that owns a weight decides which slice of the checkpoint tensor this rank reads, so the model
loader stays a loop over names.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.config import INT8_MODES
from pagedllm.distributed import TensorParallelGroup
from pagedllm.kernels import onednn
from pagedllm.kernels import ops as fused_ops
from pagedllm.kernels import gguf as gguf_kernels
from pagedllm.model.quant import EVERY_SIZE, FloatLinear, load_part
from pagedllm.model.quant.int8_trial import int8_rows_that_pay, set_ways_for_width
from pagedllm.model.quant.read_trial import set_read_way_for_machine
from pagedllm.model.weights import LazyWeight
from pagedllm.utils import cdiv

logger = logging.getLogger("pagedllm")


def _copy_into(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


def default_weight_loader(param: nn.Parameter, weight: LazyWeight) -> None:
    _copy_into(param, weight.load())


def linear(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b by the layer's method (`pagedllm.model.quant`)."""
    return layer.quant_method.apply(layer, x, bias)


def _linear_layers(model: nn.Module) -> list[nn.Module]:
    """The modules whose weight is a projection (the LM head included), each method once."""
    linears = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)
    layers: dict[int, nn.Module] = {}
    for module in model.modules():
        if isinstance(module, linears):
            layers.setdefault(id(module.quant_method), module)
    return list(layers.values())


def prepare_linear_weights(model: nn.Module) -> int:
    """Lay out every projection weight of `model` for its kernels, once the weights are loaded
    and placed (`LinearMethod.process_weights_after_loading`): float weights reordered for
    oneDNN on a CPU (float32, and 16-bit where it pays). Returns how many weights were packed."""
    layers = _linear_layers(model)
    floats = [m for m in layers if m.quant_method.dense]
    unpacked = [m for m in floats if m.quant_method.packed is None]
    for module, packed in zip(unpacked, onednn.pack_all([m.weight for m in unpacked])):
        module.quant_method.packed = packed
    for module in layers:
        module.quant_method.process_weights_after_loading(module)
    return sum(m.quant_method.packed is not None for m in floats)


def _int8_methods(model: nn.Module) -> list:
    """The methods of `model`'s projections that can run on int8 activations: GGUF blocks that
    the CPU kernels multiply (none where the weights were dequantized: a GPU, 16-bit dtypes,
    batch-invariant mode), a mixture's GGUF-packed experts included (each expert's `GGUFLinear`)."""
    methods = [m.quant_method for m in _linear_layers(model) if m.quant_method.supports_int8]
    for module in (model.modules() if model is not None else ()):
        experts = getattr(getattr(module, "experts_method", None), "gate_ups", None)
        if experts is not None:
            methods += [m for m in (*experts, *module.experts_method.downs) if m.supports_int8]
    return methods


def resolve_int8_activations(model: nn.Module, mode: str | None, batch_invariant: bool = False) -> str:
    """The int8-activation mode in force: `mode` where the user chose one, else (None) the
    default: "auto" where `model` has GGUF-quantized projections that the CPU kernels serve (the
    int8 activations llama.cpp itself computes with, wherever they measure faster), "off" where it
    has none and in batch-invariant mode, which keeps every product in float32. (An explicit
    "auto" or "on" with batch_invariant is refused earlier, by EngineArgs.)"""
    if mode is not None:
        if mode not in INT8_MODES:
            raise ValueError(f"int8_activations must be one of {', '.join(INT8_MODES)}, not {mode!r}")
        return mode
    return "auto" if not batch_invariant and _int8_methods(model) else "off"


def use_int8_activations(model: nn.Module, mode: str, by_default: bool = False) -> int:
    """Let the GGUF-packed projections of `model` run on int8 activations (a property of their
    method, `GGUFLinear.int8_rows`): "on" up to `gguf.MAX_ROWS` rows, "auto" up to the rows where
    the trial of their types' kernels finds them faster (model/quant/int8_trial.py; at every size
    where they win at the largest trial) and, for rows narrower than the trial's, the trial of
    their width too (`set_ways_for_width`), "off" never. `by_default`: the mode was not chosen but
    resolved (`resolve_int8_activations`), which the log says. Returns how many weights take them."""
    if mode not in INT8_MODES:
        raise ValueError(f"int8_activations must be one of {', '.join(INT8_MODES)}, not {mode!r}")
    methods = _int8_methods(model)
    chosen = "the default" if by_default else "chosen"
    if methods:  # (how rows are read, whatever the activations: the same results either way)
        set_read_way_for_machine()
    if mode == "off" or not methods:
        for method in methods:
            method.int8_rows = 0
        if methods:
            logger.info("int8 activations: off (%s): the %d quantized weights multiply float32 activations", chosen,
                        len(methods))
        elif mode != "off":
            logger.warning("int8_activations=%r changes nothing: the model has no quantized blocks here "
                           "(they serve GGUF weights on a CPU in float32)", mode)
        return 0
    for method in methods:
        trial = min(int8_rows_that_pay(q) for q in method.qtypes)  # (each type's kernels, once)
        method.int8_rows = gguf_kernels.MAX_ROWS if mode == "on" else trial
        if method.int8_rows:  # the ways of rows this wide, where narrower than the trial's, and
            for qtype in method.qtypes:  # ("auto") the rows where int8 still pays at this width
                width_rows = set_ways_for_width(qtype, method.in_features)
                if mode == "auto":
                    method.int8_rows = min(method.int8_rows, width_rows)
    taking = sum(m.int8_rows > 0 for m in methods)
    most = max(m.int8_rows for m in methods)
    sizes = ("no product: float32's were as fast at every trial size" if most == 0 else
             "products of every size" if most == EVERY_SIZE else f"products of up to {most} rows")
    logger.info("int8 activations: %s (%s%s; %s) for %s, on %d of %d quantized weights", mode, chosen,
                "; --int8-activations off keeps float32 activations" if by_default else "",
                gguf_kernels.ISA_NAMES[gguf_kernels.isa()], sizes, taking, len(methods))
    return taking


def _new_param(*shape: int, dtype: torch.dtype, loader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    return param


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _new_param(size, dtype=dtype, loader=default_weight_loader)

    def kernel_weight(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The weight the fused kernel multiplies rows of `dtype` by, or None where it does not serve them."""
        return self.weight if self.weight.dtype == dtype else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); or, given the residual stream, (norm(residual + x), residual + x), the sum
        written into `residual` in place on the fused CPU path."""
        weight = self.kernel_weight(x.dtype) if fused_ops.applies_to_layer(x) and x.dim() == 2 else None
        if weight is not None:
            out = fused_ops.rms_norm(x, weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = residual + x
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Reduced precision: normalise in float32, round, then scale (as transformers does).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows: each rank computes its slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.out_per_rank = tp.split(out_features, "output features")
        self.weight = _new_param(self.out_per_rank, in_features, dtype=dtype, loader=self.weight_loader)
        self.bias = _new_param(self.out_per_rank, dtype=dtype, loader=self.weight_loader) if bias else None
        self.quant_method = FloatLinear()  # chosen again when the weight arrives (quant.load_part)

    def weight_loader(self, param: nn.Parameter, weight: LazyWeight) -> None:
        start = self.tp.rank * self.out_per_rank
        shard = weight.narrow(0, start, self.out_per_rank)
        if param is self.weight:
            load_part(self, shard, 0)
        else:
            _copy_into(param, shard.load())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (gate and up of the MLP). Shard `i` of the checkpoint fills the i-th block of each rank's rows."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TensorParallelGroup, dtype: torch.dtype):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias, tp, dtype)
        self.per_rank_sizes = [tp.split(n, "output features") for n in out_sizes]

    def weight_loader(self, param: nn.Parameter, weight: LazyWeight, shard_id: int) -> None:
        size = self.per_rank_sizes[shard_id]
        offset = sum(self.per_rank_sizes[:shard_id])
        shard = weight.narrow(0, self.tp.rank * size, size)
        if param is self.weight:
            load_part(self, shard, offset, shard_id, len(self.out_sizes))
        else:
            _copy_into(param.data.narrow(0, offset, size), shard.load())


class QKVParallelLinear(ColumnParallelLinear):
    """Fused query/key/value projection, split by attention heads.

    When the group is larger than the number of KV heads, each KV head is replicated on
    `tp.size // num_kv_heads` ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
    ):
        self.head_dim = head_dim
        self.num_heads = tp.split(num_heads, "num_attention_heads")
        if tp.size >= num_kv_heads:
            if tp.size % num_kv_heads:
                valid = [d for d in range(1, num_heads + 1) if num_heads % d == 0 and (d % num_kv_heads == 0 or num_kv_heads % d == 0)]
                raise ValueError(
                    f"num_key_value_heads ({num_kv_heads}) cannot be split or replicated across "
                    f"tensor_parallel_size={tp.size}; valid sizes: {valid}."
                )
            self.num_kv_heads = 1
        else:
            self.num_kv_heads = tp.split(num_kv_heads, "num_key_value_heads")
        self.replication = max(1, tp.size // num_kv_heads)
        nn.Module.__init__(self)
        self.tp = tp
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.out_per_rank = out
        self.weight = _new_param(out, hidden_size, dtype=dtype, loader=self.weight_loader)
        self.bias = _new_param(out, dtype=dtype, loader=self.weight_loader) if bias else None
        self.quant_method = FloatLinear()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, weight: LazyWeight, shard_id: str) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp.rank * self.q_size
        else:
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size = self.kv_size
            start = (self.tp.rank // self.replication) * self.kv_size
        shard = weight.narrow(0, start, size)
        if param is self.weight:
            load_part(self, shard, offset, "qkv".index(shard_id), 3)
        else:
            _copy_into(param.data.narrow(0, offset, size), shard.load())


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns: each rank holds a slice of x, and the partial
    products are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.in_per_rank = tp.split(in_features, "input features")
        self.weight = _new_param(out_features, self.in_per_rank, dtype=dtype, loader=self.weight_loader)
        self.bias = _new_param(out_features, dtype=dtype, loader=default_weight_loader) if bias else None
        self.quant_method = FloatLinear()

    def weight_loader(self, param: nn.Parameter, weight: LazyWeight) -> None:
        load_part(self, weight.narrow(1, self.tp.rank * self.in_per_rank, self.in_per_rank), 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(linear(x, self))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; rows beyond the vocabulary pad the last shard
    (a float table's; a GGUF-packed table holds the vocabulary's rows only). Rows are looked up
    by the table's method: a quantized table dequantizes just the rows looked up."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = cdiv(vocab_size, tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.weight = _new_param(self.rows_per_rank, hidden_size, dtype=dtype, loader=self.weight_loader)
        self.quant_method = FloatLinear()

    def weight_loader(self, param: nn.Parameter, weight: LazyWeight) -> None:
        rows = self.vocab_end - self.vocab_start
        load_part(self, weight.narrow(0, self.vocab_start, rows), 0)
        if self.quant_method.dense and rows < self.rows_per_rank:
            self.weight.data[rows:].zero_()  # the padding rows

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.quant_method.embed(self, token_ids)
        outside = (token_ids < self.vocab_start) | (token_ids >= self.vocab_end)
        local = (token_ids - self.vocab_start).masked_fill(outside, 0)
        y = self.quant_method.embed(self, local).masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary, split like the embedding; logits gathered on rank 0.
    Tied to the embedding (`tie`), it multiplies by the table in the table's own form (a
    quantized table from its blocks)."""

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        """Share `embedding`'s weight and method; `retie` after the embedding's weight is replaced."""
        self.__dict__["tied_embedding"] = embedding  # not a submodule: the table is the embedding's
        self.retie()

    def retie(self) -> None:
        embedding = self.__dict__.get("tied_embedding")
        if embedding is not None:
            self.weight = embedding.weight
            self.quant_method = embedding.quant_method

    def samples_in_product(self, hidden: torch.Tensor) -> bool:
        """Whether `sample` serves `hidden`: one rank, and a weight whose method draws tokens
        with its product (`LinearMethod.samples_in_product`)."""
        return self.tp.size == 1 and self.quant_method.samples_in_product(self, hidden)

    def sample(self, hidden: torch.Tensor, draws) -> tuple[list[int], list[float]]:
        """Where `samples_in_product`: each row's token (greedy, or `draws`' top-k draw) and its
        log-probability, what `forward` then the sampler give, bitwise, from the product itself
        (`LinearMethod.sample`): the logits are not read back from memory."""
        return self.quant_method.sample(self, hidden, draws)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        local = linear(hidden, self)
        if local.shape[-1] < self.rows_per_rank:  # the quantized blocks hold no padding rows
            local = F.pad(local, (0, self.rows_per_rank - local.shape[-1]))
        logits = self.tp.gather(local, dim=-1)
        return logits[..., : self.vocab_size] if logits is not None else None
