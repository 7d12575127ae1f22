"""Mixtral: Mistral's attention and a mixture of 8 experts in every layer, the top 2 per token,
their router probabilities rescaled to sum to 1 and kept in float32 (`pagedllm.model.moe`).
Checkpoints name the MLP `block_sparse_moe` and the experts' projections w1 (gate), w3 (up),
w2 (down). GGUF: `llama` with experts, stacked per layer (kept in their blocks where every
stack has a kernel, `quant.experts.GGUFExperts`) or, in files converted before llama.cpp stacked
them, one tensor per expert (`blk.N.ffn_gate.E`, dequantized to float)."""

from __future__ import annotations

import re

from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.weights import LazyWeight
from pagedllm.transformers_utils.families import FAMILIES


class MixtralForCausalLM(LlamaForCausalLM):
    gguf_layer_tensors = FAMILIES["MixtralForCausalLM"].gguf_layer_tensors

    @classmethod
    def gguf_to_hf_name(cls, name: str) -> str:
        if match := re.fullmatch(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight", name):
            layer, part, expert = match.groups()
            return f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight"
        return super().gguf_to_hf_name(name)

    def checkpoint_targets(self, name: str, weight: LazyWeight):
        yield from super().checkpoint_targets(name.replace(".block_sparse_moe.", ".mlp."), weight)
