"""Qwen3-MoE: Qwen3's attention and a mixture of experts (`pagedllm.model.moe`) in every layer
but the dense ones (mlp_only_layers, decoder_sparse_step), router probabilities rescaled where
norm_topk_prob says so. GGUF: `qwen3moe` (experts stacked per layer, kept in their blocks where
every stack has a kernel: `quant.experts.GGUFExperts`)."""

from __future__ import annotations

from pagedllm.model.qwen3 import QWEN3_GGUF_LAYER_TENSORS, Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    gguf_layer_tensors = {
        **QWEN3_GGUF_LAYER_TENSORS,
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.experts.gate_proj",
        "ffn_up_exps": "mlp.experts.up_proj",
        "ffn_down_exps": "mlp.experts.down_proj",
    }
