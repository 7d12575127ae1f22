"""Sliding windows and logit soft-capping in the attention backends, against a dense oracle:
each sequence's whole context attended at once with an explicit mask."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedllm.attention.cpu import CPUAttentionBackend
from pagedllm.attention.reference import ReferenceAttentionBackend
from tests.test_cpu_attention import _batch, _fill_context


def _dense(query, keys, values, query_lens, context_lens, scale, window, cap):
    """Attention of each query over its sequence's contiguous keys, masked by hand."""
    out, q_start, k_start = [], 0, 0
    group = query.shape[1] // keys.shape[1]
    for q_len, ctx in zip(query_lens, context_lens):
        q = query[q_start : q_start + q_len].double()
        k = keys[k_start : k_start + ctx].double().repeat_interleave(group, dim=1)
        v = values[k_start : k_start + ctx].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        for j in range(q_len):
            p = ctx - q_len + j
            for key_pos in range(ctx):
                if key_pos > p or (window is not None and p - key_pos >= window):
                    scores[:, j, key_pos] = -math.inf
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        q_start, k_start = q_start + q_len, k_start + ctx
    return torch.cat(out)


@pytest.mark.parametrize("backend_cls", [ReferenceAttentionBackend, CPUAttentionBackend])
@pytest.mark.parametrize("window, cap", [(5, None), (None, 2.0), (17, 1.5), (1, None)])
def test_windowed_and_capped_attention_matches_a_dense_mask(backend_cls, window, cap):
    block_size, num_kv_heads, head_dim, group = 4, 2, 16, 2
    query_lens, context_lens = [1, 6, 9, 1], [1, 6, 23, 40]  # a decode, a fresh prompt, a chunk, a long decode
    gen = torch.Generator().manual_seed(0)
    tables, metadata = _batch(query_lens, context_lens, block_size, num_blocks=64, seed=1)
    keys = torch.randn(sum(context_lens), num_kv_heads, head_dim, generator=gen)
    values = torch.randn(sum(context_lens), num_kv_heads, head_dim, generator=gen)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gen) * 3
    ends = np.cumsum(context_lens)
    fresh = torch.cat([torch.arange(e - q, e) for e, q in zip(ends, query_lens)])
    backend = backend_cls()
    kc, vc = _fill_context(backend, tables, metadata, keys, values, block_size,
                           (64, block_size, num_kv_heads, head_dim), torch.float32)
    got = backend.forward(query, keys[fresh], values[fresh], kc, vc, metadata, head_dim**-0.5,
                          sliding_window=window, logits_soft_cap=cap)
    want = _dense(query, keys, values, query_lens, context_lens, head_dim**-0.5, window, cap)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    if window is not None and window < 20:  # the window really cut something: full attention differs
        full = _dense(query, keys, values, query_lens, context_lens, head_dim**-0.5, None, cap)
        assert not torch.allclose(full, want, atol=1e-3)
