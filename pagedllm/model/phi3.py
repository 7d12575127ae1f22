"""Phi-3 and Phi-4 (Phi3ForCausalLM): Llama's layers, checkpoints with q/k/v already fused
(`qkv_proj`) and gate/up fused (`gate_up_proj`), which are split here so each tensor-parallel rank
reads its heads and its MLP rows; LongRoPE and a partial rotary (Phi-4-mini) come through the
rotary (`pagedllm.model.rotary`). GGUF: `phi3` (attn_qkv, and ffn_up holding gate and up)."""

from __future__ import annotations

from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.weights import LazyWeight
from pagedllm.transformers_utils.families import FAMILIES


class Phi3ForCausalLM(LlamaForCausalLM):
    gguf_layer_tensors = FAMILIES["Phi3ForCausalLM"].gguf_layer_tensors

    def checkpoint_targets(self, name: str, weight: LazyWeight):
        if ".self_attn.qkv_proj." in name:  # [q heads | k heads | v heads] rows
            q, kv = self.cfg.num_heads * self.cfg.head_dim, self.cfg.num_kv_heads * self.cfg.head_dim
            for shard_id, start, size in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
                yield name, shard_id, weight.narrow(0, start, size)
        elif ".mlp.gate_up_proj." in name:  # [gate | up] rows
            width = weight.shape[0] // 2
            yield name, 0, weight.narrow(0, 0, width)
            yield name, 1, weight.narrow(0, width, width)
        else:
            yield from super().checkpoint_targets(name, weight)
