"""Llama-family models (Llama, Mistral, Qwen2) from GGUF or safetensors, and their tokenizers."""

from pagedllm.model.arch import SUPPORTED_ARCHITECTURES, ModelArchConfig
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.loader import ModelSource, load_arch_config, load_model, resolve_dtype, resolve_model
from pagedllm.model.tokenizer import IncrementalDetokenizer, get_tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "IncrementalDetokenizer",
    "LlamaForCausalLM",
    "ModelArchConfig",
    "ModelSource",
    "get_tokenizer",
    "load_arch_config",
    "load_model",
    "resolve_dtype",
    "resolve_model",
]
