"""The CPU KV pools: one anonymous mapping, zero from the start, mapped by a background thread."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.reference import ReferenceAttentionBackend
from pagedllm.model.memory import PageCounter
from pagedllm.worker import host_pool
from pagedllm.worker.cache_engine import CacheEngine
from pagedllm.worker.host_pool import HostKVPools


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pools_are_zero_separate_and_of_the_shape_asked(dtype):
    pools = HostKVPools(4, (3, 16, 2, 8), dtype)
    assert [tuple(t.shape) for t in pools.tensors] == [(3, 16, 2, 8)] * 4
    assert all(t.dtype == dtype and t.is_contiguous() and not t.any() for t in pools.tensors)
    pools.tensors[1].fill_(1)
    assert pools.tensors[1].all() and not pools.tensors[0].any() and not pools.tensors[2].any()
    assert pools.populated.wait(30)
    assert pools.tensors[1].all()  # populating changes no byte already written


def test_every_page_is_taken_soon_after_start_up_without_writing_it():
    pools = HostKVPools(2, (64, 1024, 64), torch.float32)  # 32 MiB, never written
    assert pools.populated.wait(60)
    counter = PageCounter()
    assert counter.resident_bytes(pools.tensors) == pools.nbytes


def test_a_pool_larger_than_the_memory_available_is_refused(monkeypatch):
    monkeypatch.setattr(host_pool, "available_memory", lambda: 1 << 20)
    with pytest.raises(MemoryError, match=r"needs 0\.03 GiB but this machine has 0\.00 GiB available: lower kv_cache_memory"):
        HostKVPools(2, (64, 1024, 64), torch.float32)


def test_the_cpu_cache_engine_keeps_its_pools_in_one_mapping():
    cache = CacheEngine(ReferenceAttentionBackend(), num_layers=3, num_kv_heads=2, head_dim=8, block_size=4,
                        num_device_blocks=5, num_cpu_blocks=2, dtype=torch.float32, device=torch.device("cpu"))
    pools = cache.key_caches + cache.value_caches
    assert cache.host_pools is not None and len({t.untyped_storage().data_ptr() for t in pools}) == 1
    assert len({t.data_ptr() for t in pools}) == 6 and not any(t.any() for t in pools)
    cache.key_caches[0][1].fill_(2.0)
    cache.copy([(1, 3)])
    assert (cache.key_caches[0][3] == 2).all() and not cache.key_caches[1].any()
