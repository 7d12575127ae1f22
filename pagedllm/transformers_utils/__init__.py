"""What a model is besides its weights: where it lives, its architecture, its tokenizer.

Torch-free, so the engine's front end (requests, detokenizing, stop checks) never loads torch;
`transformers` and `gguf` are imported only when a tokenizer or GGUF file is read.
"""

from pagedllm.transformers_utils.arch import ModelArchConfig, load_arch_config
from pagedllm.transformers_utils.detokenizer import IncrementalDetokenizer
from pagedllm.transformers_utils.families import SUPPORTED_ARCHITECTURES
from pagedllm.transformers_utils.source import ModelSource, default_model_file, resolve_model
from pagedllm.transformers_utils.tokenizer import eos_token_ids, get_tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "IncrementalDetokenizer",
    "ModelArchConfig",
    "ModelSource",
    "default_model_file",
    "eos_token_ids",
    "get_tokenizer",
    "load_arch_config",
    "resolve_model",
]
