"""Qwen3: Llama's layers with an RMSNorm over each query and key head before the rotary
(`cfg.qk_norm`) and a head size of its own (`head_dim`, not hidden_size / heads); layer types
by max_window_layers where use_sliding_window is set. GGUF: `qwen3`."""

from __future__ import annotations

from pagedllm.model.decoder import LLAMA_GGUF_LAYER_TENSORS
from pagedllm.model.llama import LlamaForCausalLM

QWEN3_GGUF_LAYER_TENSORS = {
    **LLAMA_GGUF_LAYER_TENSORS,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


class Qwen3ForCausalLM(LlamaForCausalLM):
    gguf_layer_tensors = QWEN3_GGUF_LAYER_TENSORS
