"""Every decoder layer in one C++ call (`kernels/csrc/decoder_layers.cpp`) for the steps where
Python's layer loop costs more than its arithmetic: a float32 model on a CPU whose projections
are GGUF-packed (`quant.GGUFLinear`, any type: the C++ side calls `gguf_matmul`), at up to
`gguf.MAX_ROWS` tokens (decode steps of a handful of sequences), with the C++ attention backend.
The call runs the very kernels the loop runs, in the same order on the same inputs, so its
output is bitwise the loop's (tests/test_fused_layers.py, tests/test_fused_families.py); every
other step (prompts, bfloat16, GPUs, tensor parallelism, batch-invariant mode) takes the loop.

A family says what its layers are (`CausalLM.fused_decoder_plan`: a `FusedLayer` each): Llama's
shape, plus what the others add to it: q/k head norms (Qwen3, Gemma 3), Gemma's norms over the
attention's and the MLP's outputs ("sandwich") with their (1 + w) weights, GELU's tanh form,
attention soft caps (Gemma 2), per-layer rotary tables (Gemma 3's local and global) and partial
or LongRoPE rotaries (Phi-3/4, their table rows given per step), Granite's branch multiplier,
and mixtures of experts over GGUF-packed experts (Mixtral, Qwen3-MoE: `moe_forward`, which the
loop's `SparseMoE` runs too on a float32 CPU).

`pagedllm bench latency --profile` still sees each part: while a profile is taken, the C++ side
adds each part's nanoseconds to `part_ns` (`PARTS`, in the order of its enum).
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedllm.attention import Attention

from pagedllm.kernels import build, gguf
from pagedllm.kernels.gguf import MAX_ROWS
from pagedllm.kernels.ops import as_kernel_array
from pagedllm.model.rotary import RotaryEmbedding

_P = ctypes.c_void_p
# The C++ parts, in the order of decoder_layers.cpp's enum, as the step profile names them
# ("copies": gathering q, k and v out of the fused projection, counted with the rest).
PARTS = ("norms", "projections", "rotary", "kv_write", "attention", "mlp_activation", "copies", "embedding")


_MAX_PARTS = 3  # decoder_layers.cpp's kMaxParts


class _ProjectionPart(ctypes.Structure):
    _fields_ = [("packed", _P), ("qtype_id", ctypes.c_int32), ("out_features", ctypes.c_int32)]


class _Projection(ctypes.Structure):
    _fields_ = [("parts", _ProjectionPart * _MAX_PARTS), ("bias", _P), ("num_parts", ctypes.c_int32),
                ("out_features", ctypes.c_int32), ("in_features", ctypes.c_int32), ("int8_rows", ctypes.c_int32)]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in (
        "input_norm", "pre_mlp_norm", "attn_out_norm", "mlp_out_norm", "q_norm", "k_norm")] + [
        ("qkv", _Projection), ("o", _Projection), ("gate_up", _Projection), ("down", _Projection), ("moe", _P),
        ("key_cache", _P), ("value_cache", _P), ("cos_cache", _P), ("sin_cache", _P)] + [
        (name, ctypes.c_int32) for name in ("rotary", "rotary_dim", "kv_group", "sliding_window", "activation")] + [
        (name, ctypes.c_float) for name in ("scale", "logits_soft_cap", "branch_scale")]


class _MoE(ctypes.Structure):
    _fields_ = [("router", _P), ("router_blocks", _P), ("gate_ups", _P), ("downs", _P)] + [
        (name, ctypes.c_int32) for name in (
        "num_experts", "top_k", "intermediate_size", "norm_topk_prob", "activation")]


# decoder_layers.cpp's Activation: the MLP activations it computes, by transformers' names.
ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1}


def moe_supported(moe) -> bool:
    """Whether a mixture (`moe.SparseMoE`) runs as decoder_layers.cpp's `moe_forward`: float32
    router on one rank, GGUF-packed experts of types with kernels, an activation it computes."""
    from pagedllm.model.quant.experts import GGUFExperts

    method, router = moe.experts.experts_method, moe.gate
    float_router = router.weight.dtype == torch.float32 and router.quant_method.dense
    return (moe.tp.size == 1 and router.weight.device.type == "cpu" and isinstance(method, GGUFExperts)
            and (float_router or router.quant_method.fused_parts is not None)
            and moe.experts.hidden_act in ACTIVATIONS
            and all(m.fused_parts is not None for m in (*method.gate_ups, *method.downs)))


def moe_struct(moe) -> tuple[_MoE, tuple]:
    """The C++ view of a mixture (`moe_supported`), and what must outlive it."""
    method = moe.experts.experts_method
    gate_ups = (_Projection * len(method.gate_ups))(*(_projection_of(m) for m in method.gate_ups))
    downs = (_Projection * len(method.downs))(*(_projection_of(m) for m in method.downs))
    if moe.gate.quant_method.dense:  # float32 [E, H]
        router, blocks = moe.gate.weight.detach().contiguous(), None
    else:
        router, blocks = None, _projection(moe.gate)
    struct = _MoE(router.data_ptr() if router is not None else None,
                  ctypes.addressof(blocks) if blocks is not None else None, ctypes.addressof(gate_ups),
                  ctypes.addressof(downs), len(method.downs), moe.top_k, moe.experts.per_rank,
                  int(moe.norm_topk_prob), ACTIVATIONS[moe.experts.hidden_act])
    return struct, (gate_ups, downs, router, blocks)


class _SteadyCall(NamedTuple):
    """A fused call `run_steady` may repeat: its input tensors, KV pools (the first layer's keys,
    the last's values) and profile counters, which `steady` checks, and what the C++ step reads."""

    metadata: object
    positions: torch.Tensor
    input_ids: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    part_ns: ctypes.Array | None
    step: ctypes.Structure
    args: tuple
    out: torch.Tensor


class _Step(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32) for name in (
        "num_tokens", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "block_size", "intermediate_size",
        "num_threads")] + [("eps", ctypes.c_float), ("embed_scale", ctypes.c_float), ("input_ids", _P),
        ("embed_table", _P), ("vocab_size", ctypes.c_int64), ("embed_type", ctypes.c_int32)] + [
        ("rotary_positions", _P), ("slot_mappings", _P),
        ("block_stride", ctypes.c_int64), ("head_stride", ctypes.c_int64),
        ("block_tables", _P), ("block_table_strides", _P),
        ("item_seq", _P), ("item_first_token", _P), ("item_num_tokens", _P), ("num_items", ctypes.c_int64),
        ("token_context", _P)] + [(name, _P) for name in (
        "qkv", "query", "attn", "key", "value", "normed", "gate_up", "act")]


def _projection(linear) -> _Projection:
    """The C++ view of a projection with a `GGUFLinear` method (its packed parts and bias)."""
    return _projection_of(linear.quant_method, getattr(linear, "bias", None))


def _projection_of(method, bias: torch.Tensor | None = None) -> _Projection:
    parts = [_ProjectionPart(p.data.data_ptr(), gguf.TYPE_IDS[p.qtype], p.out_features) for p in method.fused_parts]
    return _Projection((_ProjectionPart * _MAX_PARTS)(*parts), bias.data_ptr() if bias is not None else None,
                       len(parts), method.out_features, method.in_features, method.int8_rows)


@dataclass
class FusedLayer:
    """One decoder layer as the C++ call reads it: its norms' weights as the kernel multiplies
    (Gemma's 1 + w: `norm_weight`), its four projections (modules with a GGUF-packed
    `quant_method` and an optional `.bias`), its attention and rotary, and what its family adds
    (None, or 1.0: not in this family)."""

    input_norm: torch.Tensor
    pre_mlp_norm: torch.Tensor
    qkv: nn.Module
    o: nn.Module
    gate_up: nn.Module | None  # (None in a layer of experts)
    down: nn.Module | None
    attn: Attention
    rotary: RotaryEmbedding
    activation: str = "silu"
    moe: nn.Module | None = None  # a `moe.SparseMoE` in place of the dense MLP
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    branch_scale: float = 1.0

    @property
    def projections(self) -> tuple[nn.Module, ...]:
        return tuple(p for p in (self.qkv, self.o, self.gate_up, self.down) if p is not None)

    @property
    def norms(self) -> tuple[torch.Tensor, ...]:
        return tuple(n for n in (self.input_norm, self.pre_mlp_norm, self.q_norm, self.k_norm, self.attn_out_norm,
                                 self.mlp_out_norm) if n is not None)


@dataclass
class FusedDecoderPlan:
    """What a model hands the fused path (`CausalLM.fused_decoder_plan`): its layers, the
    norms' epsilon (one for every norm of the model) and its final norm's weight as the kernel
    multiplies (`norm_weight`): the call ends with the final norm, as the model's forward does.
    It starts from the token ids: `embedding` is the model's token table (the call looks rows up
    itself in a GGUF-packed or float32 one, else has the module do it) and `embed_scale` what the
    model multiplies the rows by (Gemma's sqrt(hidden_size), Granite's multiplier; float32)."""

    layers: list[FusedLayer]
    eps: float
    final_norm: torch.Tensor
    embedding: nn.Module
    embed_scale: float = 1.0

    @property
    def rotaries(self) -> list[RotaryEmbedding]:
        """The distinct rotary tables, in the order of the layers that first use each."""
        return list({id(layer.rotary): layer.rotary for layer in self.layers}.values())


def norm_weight(norm: nn.Module) -> torch.Tensor:
    """The float32 weight an RMSNorm module's kernel multiplies by (Gemma's: 1 + w), or its own
    weight where the kernel does not serve its dtype (`supported` then refuses the plan)."""
    weight = norm.kernel_weight(torch.float32)
    return weight if weight is not None else norm.weight


class FusedDecoderLayers:
    """A model's layer loop as one call; see the module's docstring."""

    PARTS = PARTS

    def __init__(self, plan: FusedDecoderPlan, backend) -> None:
        self.plan = plan
        self.layers = plan.layers
        self.rotaries = plan.rotaries
        self.backend = backend
        self.lib = build.load()
        if self.lib.decoder_layers_num_parts() != len(PARTS):  # part_ns is sized from PARTS
            raise RuntimeError("decoder_layers.cpp and fused_layers.PARTS disagree on the parts of a step")
        self._layers = None
        self._attns = [layer.attn for layer in plan.layers]
        self._group_windows: dict[int, int | None] = {}
        self._bound_to = None
        self._scratch_step: tuple[int, _Step, int, int, torch.Tensor] | None = None  # `_step`'s
        self._step_inputs: tuple | None = None  # the (metadata, positions) `_set_inputs` filled the step from
        self._inputs_held: tuple = ()
        self._steady: _SteadyCall | None = None  # the last call, where `run_steady` may repeat it
        self.part_ns: ctypes.Array | None = None  # set while a step profile is taken
        # The longest sequence for which every rotary table's rows are the positions (LongRoPE's
        # switch to its long set; None: at every length): kept inputs are checked against it.
        self.rows_limit = min((r.longrope_threshold for r in plan.rotaries if r.longrope_threshold is not None),
                              default=None)
        first = plan.layers[0]
        self.hidden_size = first.input_norm.shape[0]
        self.num_heads, self.num_kv_heads = first.attn.num_heads, first.attn.num_kv_heads
        self.head_dim = first.attn.head_dim
        dense = [layer for layer in plan.layers if layer.down is not None]
        self.intermediate_size = dense[0].down.quant_method.in_features if dense else 1
        self.eps = plan.eps
        self.final_norm = plan.final_norm
        self._table: tuple[int, int, int] | None = None  # `_token_table`'s, set with the layers' pointers

    @staticmethod
    def supported(plan: FusedDecoderPlan, backend) -> bool:
        """Whether every layer of `plan` (float32 on a CPU) can run fused with `backend`: the C++
        attention outside batch-invariant mode, every projection GGUF-packed in a type the C
        kernel serves (`LinearMethod.fused_parts`)."""
        from pagedllm.attention.cpu import CPUAttentionBackend

        if not isinstance(backend, CPUAttentionBackend) or backend.batch_invariant:
            return False
        layers = plan.layers
        if any(r.cos.dtype != torch.float32 for r in plan.rotaries):
            return False
        if plan.final_norm.dtype != torch.float32 or any(n.dtype != torch.float32 for layer in layers for n in layer.norms):
            return False
        if any(layer.activation not in ACTIVATIONS or (layer.q_norm is None) != (layer.k_norm is None)
               for layer in layers):
            return False
        projections = [p for layer in layers for p in layer.projections]
        if not all(p.quant_method.fused_parts is not None for p in projections):
            return False
        if any(layer.moe is not None and not moe_supported(layer.moe) for layer in layers):
            return False
        shapes = {(layer.attn.num_heads, layer.attn.num_kv_heads, layer.attn.head_dim) for layer in layers}
        intermediate = {layer.down.quant_method.in_features for layer in layers if layer.down is not None}
        return len(shapes) == 1 and len(intermediate) <= 1  # (the step's scratch is sized once)

    def applies(self, input_ids: torch.Tensor, metadata) -> bool:
        """A step of at most MAX_ROWS tokens (input_ids: [T]) on the CPU, none of them a prompt
        without cached context that a group's layers would run apart (torch's fused causal
        attention in the loop: `_plan`'s fresh prompts, those of more than one token with no
        cached context, within the window)."""
        if input_ids.shape[0] > MAX_ROWS or not input_ids.is_cpu:
            return False
        if metadata.num_decodes == len(metadata.query_lens):  # decodes only (the common case): no prompt
            return True
        query_lens = np.asarray(metadata.query_lens)
        seq_lens = np.asarray(metadata.seq_lens_list)
        fresh = (query_lens > 1) & (seq_lens == query_lens)
        if not fresh.any():
            return True
        self._layer_array()  # (binds the groups' windows)
        return not any(window is None or (seq_lens[fresh] <= window).any() for window in self._group_windows.values())

    def _layer_array(self) -> ctypes.Array:
        """The layers' pointers, built again if the KV pools were bound anew."""
        attns = self._attns
        if attns[0].key_cache is None:
            raise RuntimeError("Attention layer has no KV cache bound; call model.bind_kv_cache() first.")
        key_cache = attns[0].key_cache
        bound = (key_cache.data_ptr(), attns[-1].value_cache.data_ptr(), len(attns), key_cache.shape, key_cache.stride())
        if self._bound_to != bound:
            layers = []
            rotary_index = {id(r): i for i, r in enumerate(self.rotaries)}
            self._moes = []
            for layer, attn in zip(self.layers, attns):
                qkv, o = _projection(layer.qkv), _projection(layer.o)
                gate_up, down = (_projection(p) if p is not None else _Projection() for p in (layer.gate_up, layer.down))
                moe = None
                if layer.moe is not None:
                    self._moes.append(moe_struct(layer.moe))
                    moe = ctypes.addressof(self._moes[-1][0])
                norms = (layer.input_norm, layer.pre_mlp_norm, layer.attn_out_norm, layer.mlp_out_norm,
                         layer.q_norm, layer.k_norm)
                rotary = layer.rotary
                layers.append(_Layer(
                    *(n.data_ptr() if n is not None else None for n in norms), qkv, o, gate_up, down, moe,
                    attn.key_cache.data_ptr(), attn.value_cache.data_ptr(), rotary.cos.data_ptr(),
                    rotary.sin.data_ptr(), rotary_index[id(rotary)], rotary.rotary_dim, attn.kv_cache_group,
                    attn.sliding_window or 0, ACTIVATIONS[layer.activation], attn.scale,
                    attn.logits_soft_cap or 0.0, layer.branch_scale))
            self._layers = (_Layer * len(layers))(*layers)
            self._table = _token_table(self.plan.embedding)
            self._group_windows = {attn.kv_cache_group: attn.sliding_window for attn in attns}
            self._bound_to = bound
            self._scratch_step = None  # (it holds the pools' strides)
            self._steady = None
        return self._layers

    def __call__(self, positions: torch.Tensor, input_ids: torch.Tensor, metadata) -> torch.Tensor:
        """input_ids: [T] -> the final norm of the last layer's output (what the model's lookup
        and scaling, layer loop and final norm give), [T, hidden_size]."""
        layers = self._layer_array()
        num_tokens = input_ids.shape[0]
        step, hidden, residual = self._step(num_tokens)
        kept = self._step_inputs
        if kept is None or kept[0] is not metadata or kept[1] is not positions or not self._rows_hold(metadata):
            self._set_inputs(step, positions, metadata)
        step.num_threads = torch.get_num_threads()
        given_ids = input_ids
        if self._table is not None:  # the C++ step looks the rows up
            input_ids = as_kernel_array(input_ids, torch.int64)
            step.input_ids = input_ids.data_ptr()
        else:
            embedded = as_kernel_array(self.plan.embedding(input_ids), torch.float32)
            hidden, step.input_ids = embedded.data_ptr(), None
        out = torch.empty(num_tokens, self.hidden_size, dtype=torch.float32)
        args = (ctypes.addressof(layers), len(layers), ctypes.byref(step), hidden, residual, self.final_norm.data_ptr(),
                out.data_ptr(), ctypes.cast(self.part_ns, _P) if self.part_ns is not None else None)
        self._steady = None
        self._run(args)
        if self._step_inputs is not None and self._table is not None and input_ids is given_ids:
            self._steady = _SteadyCall(metadata, positions, given_ids, self._attns[0].key_cache,
                                       self._attns[-1].value_cache, self.part_ns, step, args, out)
        return out

    def steady(self, positions: torch.Tensor, input_ids: torch.Tensor, metadata) -> bool:
        """Whether `run_steady` serves a call with these inputs: the last call's very tensors (a
        decode step's inputs advanced in place, `worker.decode_inputs`, whose pointers the step
        kept), the same KV pools and profile counters, token rows looked up in C++. Identity
        checks only: no torch call."""
        kept = self._steady
        return (kept is not None and kept.metadata is metadata and kept.positions is positions
                and kept.input_ids is input_ids and kept.key_cache is self._attns[0].key_cache
                and kept.value_cache is self._attns[-1].value_cache and kept.part_ns is self.part_ns
                and self._rows_hold(metadata))

    def _rows_hold(self, metadata) -> bool:
        """Whether rotary rows kept as the positions themselves still are the rows: a LongRoPE
        table's are while no sequence is longer than its switch to the long set (`rows_limit`)."""
        return self.rows_limit is None or metadata.max_seq_len <= self.rows_limit

    def run_steady(self) -> torch.Tensor:
        """What `__call__` gives for the inputs `steady` accepted (their current contents), into
        the last call's output tensor, which it returns: a decode step keeps nothing past itself,
        and after a step has streamed the weights through the caches each torch call costs what
        fetching its code again costs (tens of microseconds)."""
        kept = self._steady
        kept.step.num_threads = torch.get_num_threads()
        self._run(kept.args)
        return kept.out

    def _run(self, args: tuple) -> None:
        if self.lib.decoder_layers_f32(*args):
            raise ValueError(f"token ids must be in [0, {self._table[2]})")

    def _set_inputs(self, step: _Step, positions: torch.Tensor, metadata) -> None:
        """The step's inputs into `step`: the attention plan, each group's block tables and slots,
        each rotary table's rows. Kept for the next call with the same `metadata` and `positions`
        (a decode step's inputs advanced in place, `worker.decode_inputs`: the same tensors one
        token further, so the same addresses), unless a table's rows are computed anew each step
        (LongRoPE's once a sequence is longer than its switch: `rows_limit`)."""
        groups = [metadata, *metadata.other_groups]
        # One plan: every group has the same work items (a step with no fresh prompt: `applies`),
        # only the block tables differ, as int32 the kernel reads.
        plan = self.backend.plan(metadata, self._group_windows.get(0))
        tables = [plan.block_tables, *(as_kernel_array(m.block_tables, torch.int32) for m in groups[1:])]
        rows = [as_kernel_array(r.table_positions(positions, metadata), torch.int64) for r in self.rotaries]
        slots = [as_kernel_array(m.slot_mapping, torch.int64) for m in groups]
        arrays = ((_P * len(rows))(*(r.data_ptr() for r in rows)), (_P * len(slots))(*(m.data_ptr() for m in slots)),
                  (_P * len(tables))(*(t.data_ptr() for t in tables)),
                  (ctypes.c_int64 * len(tables))(*(t.shape[1] for t in tables)))
        step.rotary_positions, step.slot_mappings, step.block_tables, step.block_table_strides = (
            ctypes.addressof(a) for a in arrays)
        step.item_seq, step.item_first_token = plan.item_seq.data_ptr(), plan.item_first_token.data_ptr()
        step.item_num_tokens, step.num_items = plan.item_num_tokens.data_ptr(), plan.item_seq.shape[0]
        step.token_context = plan.token_context.data_ptr()
        # (the tensors behind the addresses held as long as the step may read them)
        self._inputs_held = (arrays, plan, tables, rows, slots)
        self._step_inputs = (metadata, positions) if all(r is positions for r in rows) else None

    def _step(self, num_tokens: int) -> tuple[_Step, int, int]:
        """The C++ step of `num_tokens` tokens and the addresses of its hidden states' and its
        residual stream's buffers, with its scratch (the last size's kept: a batch decodes at one
        size for many steps); the caller fills in the step's inputs (`_set_inputs`)."""
        if self._scratch_step is None or self._scratch_step[0] != num_tokens:
            T, H, I = num_tokens, self.hidden_size, self.intermediate_size
            q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            widths = (q_width + 2 * kv_width, q_width, q_width, kv_width, kv_width, H, 2 * I, I, H, H)
            scratch = torch.empty(T * sum(widths), dtype=torch.float32)
            pointers, offset = [], 0
            for width in widths:
                pointers.append(scratch.data_ptr() + 4 * offset)
                offset += T * width
            key_cache = self.layers[0].attn.key_cache
            kind, table, vocab = self._table or (-1, None, 0)
            step = _Step(T, H, self.num_heads, self.num_kv_heads, self.head_dim, key_cache.shape[2], I, 0, self.eps,
                         self.plan.embed_scale, None, table, vocab, kind, None, None, key_cache.stride(0),
                         key_cache.stride(1), None, None, None, None, None, 0, None, *pointers[:-2])
            self._scratch_step = (num_tokens, step, pointers[-2], pointers[-1], scratch)
            self._step_inputs = self._steady = None
        return self._scratch_step[1:4]


def _token_table(embedding: nn.Module) -> tuple[int, int, int] | None:
    """(the C++ step's embed_type, the table's address, its rows) of a token table the step reads
    rows of itself: GGUF-packed in one part, or dense float32; None for any other (the embedding
    module then looks the rows up)."""
    method = embedding.quant_method
    parts = method.fused_parts
    if parts is not None and len(parts) == 1:
        (table,) = parts
        return gguf.TYPE_IDS[table.qtype], table.data.data_ptr(), table.out_features
    if method.dense:
        weight = embedding.weight
        if weight.dtype == torch.float32 and weight.is_contiguous() and weight.device.type == "cpu":
            return -1, weight.data_ptr(), weight.shape[0]
    return None


def enable_fused_layers(model, backend) -> bool:
    """Give `model` (a `CausalLM`) the fused path where its layers take it (the model's
    `fused_decoder_plan`) and `backend` and its weights support it; returns whether."""
    plan = model.fused_decoder_plan()
    supported = plan is not None and FusedDecoderLayers.supported(plan, backend)
    model.fused_layers = FusedDecoderLayers(plan, backend) if supported else None
    return supported
