"""Llama-family models (Llama, Mistral, Qwen2) from tensor-parallel-aware layers, with weights
loaded from GGUF or safetensors."""

from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.loader import load_model, resolve_dtype

__all__ = ["LlamaForCausalLM", "load_model", "resolve_dtype"]
