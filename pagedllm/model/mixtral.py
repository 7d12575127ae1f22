"""Mixtral: Mistral's attention and a mixture of 8 experts in every layer, the top 2 per token,
their router probabilities rescaled to sum to 1 and kept in float32 (`pagedllm.model.moe`).
Checkpoints name the MLP `block_sparse_moe` and the experts' projections w1 (gate), w3 (up),
w2 (down). GGUF: `llama` with experts (stacked per layer, dequantized to float)."""

from __future__ import annotations

from pagedllm.model.decoder import LLAMA_GGUF_LAYER_TENSORS
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.weights import LazyWeight


class MixtralForCausalLM(LlamaForCausalLM):
    gguf_layer_tensors = {
        **LLAMA_GGUF_LAYER_TENSORS,
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.experts.gate_proj",
        "ffn_up_exps": "mlp.experts.up_proj",
        "ffn_down_exps": "mlp.experts.down_proj",
    }

    def checkpoint_targets(self, name: str, weight: LazyWeight):
        yield from super().checkpoint_targets(name.replace(".block_sparse_moe.", ".mlp."), weight)
