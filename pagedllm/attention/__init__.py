"""Attention backends behind one interface: the reference (plain torch) and faster ones."""

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata, get_attention_backend
from pagedllm.attention.layer import Attention

__all__ = ["Attention", "AttentionBackend", "AttentionMetadata", "get_attention_backend"]
