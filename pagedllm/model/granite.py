"""Granite (GraniteForCausalLM): Llama's layers with IBM's four multipliers: the embeddings times
embedding_multiplier, each attention and MLP output times residual_multiplier before its residual
add, the logits divided by logits_scaling, and the attention scores scaled by
attention_multiplier (read into `cfg.query_pre_attn_scalar`). GGUF: `granite`."""

from __future__ import annotations

import torch

from pagedllm.model.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg, layer, rotary, backend, tp, dtype, mlp):
        super().__init__(cfg, layer, rotary, backend, tp, dtype, mlp)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, positions, hidden, residual, metadata):
        """As Llama's (the residual add fused into the next norm), each branch scaled first."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual


class GraniteModel(LlamaModel):
    decoder_layer = GraniteDecoderLayer

    def __init__(self, cfg, max_position, backend, tp, dtype, make_mlp):
        super().__init__(cfg, max_position, backend, tp, dtype, make_mlp)
        self.embedding_multiplier = cfg.embedding_multiplier

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    def build_model(self, max_position, backend, tp, dtype) -> GraniteModel:
        return GraniteModel(self.cfg, max_position, backend, tp, dtype, lambda layer: self.make_mlp(layer, tp, dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        return None if logits is None else logits / self.cfg.logits_scaling
