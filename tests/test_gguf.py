"""GGUF loading: dequantization, undoing llama.cpp's rotary permutation, sharded reads, and the
embedded SmolLM2 against transformers loading the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.transformers_utils import resolve_model
from pagedllm.model.quant import dense_weight
from pagedllm.model.weights import GGUFWeight, unpermute_rotary_rows


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (the inverse of what we undo)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)  # 6 heads of dim 8
    permuted = _llama_cpp_permute(w, 6)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rotary_rows(permuted, 6), w)
    # Head by head, so slicing whole heads first gives the same rows.
    np.testing.assert_array_equal(unpermute_rotary_rows(permuted[16:32], 2), w[16:32])


@pytest.fixture(scope="module")
def gguf_reader():
    import gguf

    return gguf.GGUFReader(str(resolve_model(None).path))


def test_gguf_row_and_column_slices_equal_slices_of_the_full_tensor(gguf_reader):
    """Tensor-parallel ranks read only their slice; it must equal slicing after a full load."""
    tensors = {t.name: t for t in gguf_reader.tensors}
    q = GGUFWeight(tensors["blk.0.attn_q.weight"], rotary_head_dim=64)
    full = q.load()
    assert full.shape == (576, 576)
    torch.testing.assert_close(q.narrow(0, 192, 192).load(), full[192:384], atol=0, rtol=0)
    down = GGUFWeight(tensors["blk.0.ffn_down.weight"])
    torch.testing.assert_close(down.narrow(1, 512, 512).load(), down.load()[:, 512:1024], atol=0, rtol=0)
    norm = GGUFWeight(tensors["blk.0.attn_norm.weight"])
    assert norm.shape == (576,) and norm.load().dtype == torch.float32


@pytest.mark.slow
def test_gguf_weights_equal_transformers_load(smollm_hf, smollm_llm):
    ours = smollm_llm.llm_engine.executor.worker.model
    layer, ref = ours.layer_projections(3), smollm_hf.model.layers[3]
    qkv = dense_weight(ours, layer["qkv_proj"])  # dequantized from the packed blocks
    torch.testing.assert_close(qkv[:576], ref.self_attn.q_proj.weight, atol=0, rtol=0)
    torch.testing.assert_close(qkv[576:768], ref.self_attn.k_proj.weight, atol=0, rtol=0)
    torch.testing.assert_close(qkv[768:], ref.self_attn.v_proj.weight, atol=0, rtol=0)
    gate_up = dense_weight(ours, layer["gate_up_proj"])
    torch.testing.assert_close(gate_up[:1536], ref.mlp.gate_proj.weight, atol=0, rtol=0)
    torch.testing.assert_close(dense_weight(ours, ours.embedding_weight), smollm_hf.model.embed_tokens.weight, atol=0, rtol=0)
    assert ours.cfg.tie_word_embeddings and ours.lm_head.weight is ours.embedding_weight
