"""The model families (`registry.MODELS`: Llama, Mistral, Qwen2/3 dense and MoE, Mixtral, Gemma 2/3,
Phi-3, OPT) from tensor-parallel-aware layers, behind one interface (`interface.CausalLM`), with
weights loaded from GGUF or safetensors."""

from pagedllm.model.interface import CausalLM
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.loader import load_model, resolve_dtype
from pagedllm.model.registry import MODELS, model_class

__all__ = ["MODELS", "CausalLM", "LlamaForCausalLM", "load_model", "model_class", "resolve_dtype"]
