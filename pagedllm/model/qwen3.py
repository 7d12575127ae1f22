"""Qwen3: Llama's layers with an RMSNorm over each query and key head before the rotary
(`cfg.qk_norm`) and a head size of its own (`head_dim`, not hidden_size / heads); layer types
by max_window_layers where use_sliding_window is set. GGUF: `qwen3`."""

from __future__ import annotations

from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.transformers_utils.families import FAMILIES


class Qwen3ForCausalLM(LlamaForCausalLM):
    gguf_layer_tensors = FAMILIES["Qwen3ForCausalLM"].gguf_layer_tensors
