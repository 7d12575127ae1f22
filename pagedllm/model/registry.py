"""Which class serves each architecture (config.json's `architectures[0]`; a GGUF file's
`general.architecture` is mapped to one of these by its entry in `transformers_utils.families`)."""

from __future__ import annotations

from pagedllm.model.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from pagedllm.model.granite import GraniteForCausalLM
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.mixtral import MixtralForCausalLM
from pagedllm.model.opt import OPTForCausalLM
from pagedllm.model.phi3 import Phi3ForCausalLM
from pagedllm.model.qwen3 import Qwen3ForCausalLM
from pagedllm.model.qwen3_moe import Qwen3MoeForCausalLM
from pagedllm.transformers_utils.families import SUPPORTED_ARCHITECTURES

MODELS: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
}
assert tuple(MODELS) == SUPPORTED_ARCHITECTURES, "every family of transformers_utils.families needs a class"


def model_class(architecture: str) -> type:
    """The class that serves `architecture`."""
    if architecture not in MODELS:
        raise ValueError(f"Unsupported model architecture {architecture!r}. Supported architectures: {', '.join(MODELS)}.")
    return MODELS[architecture]
