"""What every family's `CausalLM` shares (`pagedllm.model.interface`): the attention layers and
their KV cache, the logits, and loading a checkpoint by name.

A family subclasses `DecoderForCausalLM`, builds the decoder (`build_model`: `self.model`, with
the `Attention` layers in layer order; the LM head is made here, tied where the config says),
and states its checkpoint's names: `stacked_params` (checkpoint projections fused into one of
our parameters), `checkpoint_targets` for anything else (fused checkpoints split, experts), and
its GGUF tensor names (`gguf_layer_tensors`, from its entry in `transformers_utils.families`;
`gguf_weight` for a tensor llama.cpp stores transformed).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from pagedllm.attention import Attention, AttentionBackend, AttentionMetadata
from pagedllm.distributed import TensorParallelGroup
from pagedllm.kv_spec import AttentionSpec
from pagedllm.model.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)
from pagedllm.model.weights import LazyWeight
from pagedllm.transformers_utils.arch import ModelArchConfig
from pagedllm.transformers_utils.families import GGUF_TOP_TENSORS, LLAMA_LAYER_TENSORS

# Checkpoint projections that Llama-shaped families fuse: (our parameter, checkpoint name, shard id).
LLAMA_STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class DecoderForCausalLM(nn.Module):
    stacked_params: tuple[tuple[str, str, Any], ...] = LLAMA_STACKED_PARAMS
    # llama.cpp's names -> ours: a family whose names are not Llama's reads its own from its entry
    # in `transformers_utils.families` (`FAMILIES[...].gguf_layer_tensors`).
    gguf_layer_tensors: Mapping[str, str] = LLAMA_LAYER_TENSORS
    gguf_top_tensors = GGUF_TOP_TENSORS
    # Checkpoint tensors with no parameter (derived buffers some checkpoints save).
    ignored_tensors = ("rotary_emb.inv_freq",)

    def __init__(
        self,
        cfg: ModelArchConfig,
        max_position: int,
        backend: AttentionBackend,
        tp: TensorParallelGroup = TensorParallelGroup(),
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.model = self.build_model(max_position, backend, tp, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, self.embedding_weight.shape[1], tp, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.tie(self.embedding_module)

    def build_model(self, max_position: int, backend: AttentionBackend, tp: TensorParallelGroup,
                    dtype: torch.dtype) -> nn.Module:
        """The decoder (`self.model`): embeddings, layers, final norm; forward(ids, positions,
        metadata) -> hidden states."""
        raise NotImplementedError

    # --- the step --------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [n, hidden_size] -> logits [n, vocab_size] on rank 0 (None on other ranks),
        soft-capped where the model caps them (Gemma)."""
        logits = self.lm_head(hidden)
        cap = self.cfg.final_logit_softcapping
        if logits is not None and cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def samples_in_head(self, hidden: torch.Tensor) -> bool:
        """Whether `head_samples` serves `hidden` [n, hidden_size]: the head draws tokens with its
        product (`ParallelLMHead.samples_in_product`) and the logits are not soft-capped (else
        `compute_logits` and the sampler)."""
        return self.cfg.final_logit_softcapping is None and self.lm_head.samples_in_product(hidden)

    def head_samples(self, hidden: torch.Tensor, draws) -> tuple[list[int], list[float]]:
        """Where `samples_in_head`: each row's token (greedy, or `draws`' top-k draw:
        `kernels.gguf.Draws`) and its log-probability, from the head's product."""
        return self.lm_head.sample(hidden, draws)

    # --- the KV cache ----------------------------------------------------------------------

    @property
    def attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def kv_cache_spec(self) -> list[AttentionSpec]:
        """What each layer stores in the KV cache on this rank (one entry per layer)."""
        return [AttentionSpec(a.num_kv_heads, a.head_dim, a.sliding_window) for a in self.attention_layers]

    def bind_kv_cache(
        self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], kv_cache_groups: list[int] | None = None
    ) -> None:
        """Give each attention layer its key and value block pools, and the KV cache group whose
        block tables address them (`kv_spec.kv_cache_groups`; all 0 by default)."""
        groups = kv_cache_groups or [0] * len(key_caches)
        for attn, k, v, group in zip(self.attention_layers, key_caches, value_caches, groups, strict=True):
            attn.key_cache, attn.value_cache, attn.kv_cache_group = k, v, group

    # --- what benchmarks and the fused path ask ---------------------------------------------

    def layer_projections(self, layer: int) -> dict[str, nn.Parameter]:
        """Layer `layer`'s projection weights, by name, in the order a step applies them."""
        raise NotImplementedError

    def step_projection_weights(self) -> list[nn.Parameter]:
        """Every projection weight of one decode step, in the order the model applies them (the
        LM head last)."""
        weights = [w for i in range(self.cfg.num_layers) for w in self.layer_projections(i).values()]
        return weights + [self.lm_head.weight]

    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether a decode step can be captured as a CUDA graph (nothing in the forward pass
        waits on the host). A mixture of experts reads its experts' token counts on the host;
        windows and soft-caps are the Triton kernels' compile-time constants, and the graphs keep
        a static plan per KV cache group, so they are captured too."""
        return self.cfg.moe is None

    @property
    def embedding_weight(self) -> nn.Parameter:
        return self.model.embed_tokens.weight

    @property
    def embedding_module(self) -> VocabParallelEmbedding:
        """The token embedding (whose table a tied LM head multiplies by)."""
        return next(m for m in self.modules() if isinstance(m, VocabParallelEmbedding)
                    and not isinstance(m, ParallelLMHead) and m.weight is self.embedding_weight)

    def tie_weights(self) -> None:
        """A tied head shares the table again after loading replaced it (a GGUF table's blocks)."""
        self.lm_head.retie()

    def fused_decoder_plan(self):
        """What `pagedllm.model.fused_layers` needs to run every layer in one C++ call, or None
        where this model's layers are not the shape that call computes (the default)."""
        return None

    @property
    def fused_layers(self):
        return getattr(self.model, "fused_layers", None)

    @fused_layers.setter
    def fused_layers(self, fused) -> None:
        self.model.fused_layers = fused

    # --- checkpoints -----------------------------------------------------------------------

    def checkpoint_targets(self, name: str, weight: LazyWeight) -> Iterator[tuple[str, Any, LazyWeight]]:
        """(our parameter, shard id or None, lazy weight) for one checkpoint tensor: the fused
        projections through `stacked_params`, anything else under its own name."""
        for fused, original, shard_id in self.stacked_params:
            if f".{original}." in name:
                yield name.replace(f".{original}.", f".{fused}."), shard_id, weight
                return
        yield name, None, weight

    def load_weights(self, weights: Iterable[tuple[str, LazyWeight]]) -> None:
        """Fill every parameter from (checkpoint name, lazy weight) pairs, Hugging Face names
        (GGUF names are mapped to these first); each layer reads its own slice. A tensor with no
        parameter, or a parameter nothing filled, is an error naming it."""
        params = dict(self.named_parameters(remove_duplicate=False))
        tied = self.cfg.tie_word_embeddings
        loaded: set[tuple[str, Any]] = set()
        for name, weight in weights:
            if any(part in name for part in self.ignored_tensors) or (name == "lm_head.weight" and tied):
                continue
            for target, shard_id, part in self.checkpoint_targets(name, weight):
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {self.cfg.architecture}")
                param = params[target]
                loader = getattr(param, "weight_loader", default_weight_loader)
                filled = loader(param, part) if shard_id is None else loader(param, part, shard_id)
                loaded.update((target, s) for s in (filled or [shard_id]))
        missing = sorted(f"{n}:{s}" if s is not None else n for n, s in self._expected_shards(params, tied) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:5]}")
        self.tie_weights()

    def _expected_shards(self, params: dict[str, nn.Parameter], tied: bool) -> set[tuple[str, Any]]:
        expected = set()
        for name, param in params.items():
            if name == "lm_head.weight" and tied:
                continue
            owner = self.get_submodule(name.rpartition(".")[0])  # (loading may have replaced the parameter)
            if isinstance(owner, QKVParallelLinear):
                shards = ("q", "k", "v")
            elif isinstance(owner, MergedColumnParallelLinear):
                shards = tuple(range(len(owner.out_sizes)))
            elif hasattr(owner, "expected_shards"):
                shards = owner.expected_shards(name.rpartition(".")[2])
            else:
                shards = (None,)
            expected.update((name, s) for s in shards)
        return expected

    @classmethod
    def gguf_to_hf_name(cls, name: str) -> str:
        """A GGUF tensor's name as this family's Hugging Face checkpoint names it."""
        base, _, suffix = name.rpartition(".")
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        if match and match.group(2) in cls.gguf_layer_tensors:
            return f"model.layers.{match.group(1)}.{cls.gguf_layer_tensors[match.group(2)]}.{suffix}"
        if base in cls.gguf_top_tensors:
            return f"{cls.gguf_top_tensors[base]}.{suffix}"
        raise ValueError(f"GGUF tensor {name!r} is not supported by pagedllm's {cls.__name__} loader.")

    @classmethod
    def gguf_weight(cls, hf_name: str, weight: LazyWeight) -> LazyWeight:
        """The checkpoint value of a GGUF tensor (the identity; Gemma's norms are stored + 1)."""
        return weight


def build_attention(cfg: ModelArchConfig, layer: int, num_heads: int, num_kv_heads: int, backend: AttentionBackend,
                    scale: float | None = None, logits_soft_cap: float | None = None) -> Attention:
    """The paged attention of layer `layer`: its window, and the scale of its scores."""
    if scale is None:
        scalar = cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None else cfg.head_dim
        scale = scalar**-0.5
    return Attention(num_heads, num_kv_heads, cfg.head_dim, scale, backend,
                     sliding_window=cfg.layer_sliding_window(layer), logits_soft_cap=logits_soft_cap)
