"""Qwen3-MoE: Qwen3's attention and a mixture of experts (`pagedllm.model.moe`) in every layer
but the dense ones (mlp_only_layers, decoder_sparse_step), router probabilities rescaled where
norm_topk_prob says so. GGUF: `qwen3moe` (experts stacked per layer, kept in their blocks where
every stack has a kernel: `quant.experts.GGUFExperts`)."""

from __future__ import annotations

from pagedllm.model.qwen3 import Qwen3ForCausalLM
from pagedllm.transformers_utils.families import FAMILIES


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    gguf_layer_tensors = FAMILIES["Qwen3MoeForCausalLM"].gguf_layer_tensors
