"""The interface every model family implements (`CausalLM`), and what each part of the engine
asks of it. A family is one module defining a class with these members (most come from
`pagedllm.model.decoder.DecoderForCausalLM`) plus one line in `pagedllm.model.registry.MODELS`.

Who calls what:
- the loader: `cls(cfg, max_position, backend, tp, dtype)`, then `load_weights` with Hugging Face
  names (a GGUF file's through `cls.gguf_to_hf_name` and `cls.gguf_weight`);
- the worker: `kv_cache_spec` (the KV cache manager groups layers by it), `bind_kv_cache`, then
  `forward` and `compute_logits` every step; `fused_decoder_plan` / `fused_layers` for the C++
  layer loop (`pagedllm.model.fused_layers`);
- CUDA graphs: `supports_cuda_graphs`, `attention_layers` (heads and head size of the decode plan);
- `pagedllm bench matmul` and tests: `step_projection_weights`, `layer_projections`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from pagedllm.attention import Attention, AttentionMetadata
from pagedllm.kv_spec import AttentionSpec
from pagedllm.model.weights import LazyWeight
from pagedllm.transformers_utils.arch import ModelArchConfig


@runtime_checkable
class CausalLM(Protocol):
    cfg: ModelArchConfig

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """The scheduled tokens of every sequence back to back ([num_tokens] ids and positions)
        -> their last hidden states [num_tokens, hidden_size]."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Rows of hidden states -> logits [rows, vocab_size] on tensor-parallel rank 0 (None on
        the others)."""

    def load_weights(self, weights: Iterable[tuple[str, LazyWeight]]) -> None:
        """Every parameter from (Hugging Face name, lazy tensor) pairs; each tensor-parallel
        rank reads its own slice. Unknown or missing tensors raise ValueError."""

    @classmethod
    def gguf_to_hf_name(cls, name: str) -> str:
        """A GGUF tensor name as the family's Hugging Face checkpoint names it."""

    @classmethod
    def gguf_weight(cls, hf_name: str, weight: LazyWeight) -> LazyWeight:
        """A GGUF tensor's value as the Hugging Face checkpoint holds it."""

    def kv_cache_spec(self) -> list[AttentionSpec]:
        """One entry per attention layer: this rank's KV heads, the head size, the window."""

    def bind_kv_cache(
        self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], kv_cache_groups: list[int] | None = None
    ) -> None:
        """Give each attention layer its key and value block pools (in `kv_cache_spec` order) and
        the KV cache group whose block tables address them (all 0 by default)."""

    @property
    def attention_layers(self) -> list[Attention]: ...

    def layer_projections(self, layer: int) -> dict[str, nn.Parameter]:
        """One layer's projection weights by name, in the order a step applies them."""

    def step_projection_weights(self) -> list[nn.Parameter]:
        """Every projection weight of a decode step, the LM head last."""

    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether a decode step's forward pass can be captured (no host synchronisation)."""

    def fused_decoder_plan(self) -> Any:
        """A `fused_layers.FusedDecoderPlan` where the layers are what the C++ loop computes, else None."""

    fused_layers: Any  # the installed `FusedDecoderLayers`, or None
