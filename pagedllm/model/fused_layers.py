"""Every decoder layer in one C++ call (`kernels/csrc/decoder_layers.cpp`) for the steps where
Python's layer loop costs more than its arithmetic: a float32 model on a CPU whose projections
are GGUF-packed (`quant.GGUFLinear`, any type: the C++ side calls `gguf_matmul`), at up to
`gguf.MAX_ROWS` tokens (decode steps of a handful of sequences), with the C++ attention backend. The call runs the very kernels the loop runs, in
the same order on the same inputs, so its output is bitwise the loop's (tests/test_fused_layers.py);
every other step (prompts, bfloat16, GPUs, tensor parallelism, batch-invariant mode) takes the
loop.

`pagedllm bench latency --profile` still sees each part: while a profile is taken, the C++ side
adds each part's nanoseconds to `part_ns` (`PARTS`, in the order of its enum).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.attention import Attention

from pagedllm.kernels import build, gguf
from pagedllm.kernels.gguf import MAX_ROWS
from pagedllm.model.rotary import RotaryEmbedding

_P = ctypes.c_void_p
# The C++ parts, in the order of decoder_layers.cpp's enum, as the step profile names them
# ("copies": gathering q, k and v out of the fused projection, counted with the rest).
PARTS = ("norms", "projections", "rotary", "kv_write", "attention", "mlp_activation", "copies")


_MAX_PARTS = 3  # decoder_layers.cpp's kMaxParts


class _ProjectionPart(ctypes.Structure):
    _fields_ = [("packed", _P), ("qtype_id", ctypes.c_int32), ("out_features", ctypes.c_int32)]


class _Projection(ctypes.Structure):
    _fields_ = [("parts", _ProjectionPart * _MAX_PARTS), ("bias", _P), ("num_parts", ctypes.c_int32),
                ("out_features", ctypes.c_int32), ("in_features", ctypes.c_int32), ("int8_rows", ctypes.c_int32)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_attention_norm", _P), ("qkv", _Projection), ("o", _Projection),
                ("gate_up", _Projection), ("down", _Projection), ("key_cache", _P), ("value_cache", _P),
                ("kv_group", ctypes.c_int32), ("sliding_window", ctypes.c_int32)]


class _Step(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in (
        "num_tokens", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "block_size", "intermediate_size",
        "num_threads")] + [("eps", ctypes.c_float), ("scale", ctypes.c_float)] + [
        ("positions", _P), ("cos_cache", _P), ("sin_cache", _P), ("slot_mappings", _P),
        ("block_stride", ctypes.c_int64), ("head_stride", ctypes.c_int64),
        ("block_tables", _P), ("block_table_strides", _P),
        ("item_seq", _P), ("item_first_token", _P), ("item_num_tokens", _P), ("num_items", ctypes.c_int64),
        ("token_context", _P)] + [(name, _P) for name in (
        "qkv", "query", "attn", "key", "value", "normed", "gate_up", "act")]


def _projection(linear) -> _Projection:
    """The C++ view of a projection with a `GGUFLinear` method (its packed parts and bias)."""
    method = linear.quant_method
    parts = []
    for part in method.fused_parts:
        parts.append(_ProjectionPart(part.data.data_ptr(), gguf.TYPE_IDS[part.qtype], part.out_features))
    bias = getattr(linear, "bias", None)
    return _Projection((_ProjectionPart * _MAX_PARTS)(*parts), bias.data_ptr() if bias is not None else None,
                       len(parts), method.out_features, method.in_features, method.int8_rows)


@dataclass
class FusedLayer:
    """One decoder layer as the C++ call reads it: its two norms' weights, its four projections
    (modules with a GGUF-packed `quant_method` and an optional `.bias`) and its attention."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: nn.Module
    o: nn.Module
    gate_up: nn.Module
    down: nn.Module
    attn: Attention

    @property
    def projections(self) -> tuple[nn.Module, ...]:
        return (self.qkv, self.o, self.gate_up, self.down)


@dataclass
class FusedDecoderPlan:
    """What a model hands the fused path (`CausalLM.fused_decoder_plan`): its layers, the
    rotary table they share (whole heads, row = position) and the norms' epsilon."""

    layers: list[FusedLayer]
    rotary: RotaryEmbedding
    eps: float


class FusedDecoderLayers:
    """The layer loop of a Llama-shaped model as one call; see the module's docstring."""

    PARTS = PARTS

    def __init__(self, plan: FusedDecoderPlan, backend) -> None:
        self.plan = plan
        self.layers = plan.layers
        self.backend = backend
        self.lib = build.load()
        if self.lib.decoder_layers_num_parts() != len(PARTS):  # part_ns is sized from PARTS
            raise RuntimeError("decoder_layers.cpp and fused_layers.PARTS disagree on the parts of a step")
        self._layers = None
        self._group_windows: dict[int, int | None] = {}
        self._bound_to = None
        self.part_ns: ctypes.Array | None = None  # set while a step profile is taken
        first = plan.layers[0]
        self.hidden_size = first.input_norm.shape[0]
        self.num_heads, self.num_kv_heads = first.attn.num_heads, first.attn.num_kv_heads
        self.head_dim = first.attn.head_dim
        self.intermediate_size = first.down.quant_method.in_features
        self.eps, self.scale = plan.eps, first.attn.scale

    @staticmethod
    def supported(plan: FusedDecoderPlan, backend) -> bool:
        """Whether every layer of `plan` (float32 on a CPU) can run fused with `backend`: the C++
        attention outside batch-invariant mode, every projection GGUF-packed in a type the C
        kernel serves (`LinearMethod.fused_parts`)."""
        from pagedllm.attention.cpu import CPUAttentionBackend

        if not isinstance(backend, CPUAttentionBackend) or backend.batch_invariant:
            return False
        if plan.layers[0].input_norm.dtype != torch.float32 or plan.rotary.cos.dtype != torch.float32:
            return False
        if any(layer.attn.logits_soft_cap is not None for layer in plan.layers):
            return False  # (no Llama-shaped family caps its logits)
        projections = [p for layer in plan.layers for p in layer.projections]
        return all(p.quant_method.fused_parts is not None for p in projections)

    def applies(self, hidden: torch.Tensor, metadata) -> bool:
        """A step of at most MAX_ROWS tokens, none of them a prompt without cached context (those
        take torch's fused causal attention in the loop)."""
        return (hidden.shape[0] <= MAX_ROWS and hidden.device.type == "cpu"
                and not any(plan.fresh_prompts for plan in self._plans(metadata)))

    def _plans(self, metadata) -> list:
        """The attention plan of each KV cache group, as its layers would make it."""
        self._layer_array()  # (binds the groups' windows)
        groups = [metadata, *metadata.other_groups]
        return [self.backend.plan(m, self._group_windows.get(g)) for g, m in enumerate(groups)]

    def _layer_array(self) -> ctypes.Array:
        """The layers' pointers, built again if the KV pools were bound anew."""
        attns = [layer.attn for layer in self.layers]
        if attns[0].key_cache is None:
            raise RuntimeError("Attention layer has no KV cache bound; call model.bind_kv_cache() first.")
        bound = (attns[0].key_cache.data_ptr(), attns[-1].value_cache.data_ptr(), len(attns))
        if self._bound_to != bound:
            layers = []
            for layer, attn in zip(self.layers, attns):
                qkv, o, gate_up, down = (_projection(p) for p in layer.projections)
                layers.append(_Layer(layer.input_norm.data_ptr(), layer.post_attention_norm.data_ptr(),
                                     qkv, o, gate_up, down, attn.key_cache.data_ptr(), attn.value_cache.data_ptr(),
                                     attn.kv_cache_group, attn.sliding_window or 0))
            self._layers = (_Layer * len(layers))(*layers)
            self._group_windows = {attn.kv_cache_group: attn.sliding_window for attn in attns}
            self._bound_to = bound
        return self._layers

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor, metadata) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the embeddings [T, hidden_size] -> (last layer's output, residual stream), as
        the loop leaves them for the final norm."""
        layers = self._layer_array()
        groups = [metadata, *metadata.other_groups]
        plans = self._plans(metadata)  # the same work items: only the block tables differ
        plan = plans[0]
        slot_mappings = (_P * len(groups))(*(m.slot_mapping.data_ptr() for m in groups))
        block_tables = (_P * len(groups))(*(p.block_tables.data_ptr() for p in plans))
        table_strides = (ctypes.c_int64 * len(groups))(*(p.block_tables.shape[1] for p in plans))
        rotary = self.plan.rotary
        key_cache = self.layers[0].attn.key_cache
        T, H, I = hidden.shape[0], self.hidden_size, self.intermediate_size
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        widths = (q_width + 2 * kv_width, q_width, q_width, kv_width, kv_width, H, 2 * I, I)
        scratch = torch.empty(T * sum(widths), dtype=torch.float32)
        pointers, offset = [], 0
        for width in widths:
            pointers.append(scratch.data_ptr() + 4 * offset)
            offset += T * width
        hidden = hidden.contiguous()
        residual = torch.empty_like(hidden)
        positions = positions.contiguous()
        step = _Step(
            T, H, self.num_heads, self.num_kv_heads, self.head_dim, key_cache.shape[2], I, torch.get_num_threads(),
            self.eps, self.scale, positions.data_ptr(), rotary.cos.data_ptr(), rotary.sin.data_ptr(),
            ctypes.addressof(slot_mappings), key_cache.stride(0), key_cache.stride(1), ctypes.addressof(block_tables),
            ctypes.addressof(table_strides), plan.item_seq.data_ptr(), plan.item_first_token.data_ptr(),
            plan.item_num_tokens.data_ptr(), plan.item_seq.shape[0], plan.token_context.data_ptr(), *pointers,
        )
        self.lib.decoder_layers_f32(ctypes.addressof(layers), len(layers), ctypes.byref(step), hidden.data_ptr(),
                                    residual.data_ptr(), ctypes.cast(self.part_ns, _P) if self.part_ns is not None else None)
        return hidden, residual


def enable_fused_layers(model, backend) -> bool:
    """Give `model` (a `CausalLM`) the fused path where its layers take it (the model's
    `fused_decoder_plan`) and `backend` and its weights support it; returns whether."""
    plan = model.fused_decoder_plan()
    supported = plan is not None and FusedDecoderLayers.supported(plan, backend)
    model.fused_layers = FusedDecoderLayers(plan, backend) if supported else None
    return supported
