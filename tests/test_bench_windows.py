"""`pagedllm bench windows` on tiny models: the freed run holds fewer blocks than the one that
keeps every block, at the bound the block manager states, with the same tokens."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.bench.windows import measure
from pagedllm.kv_spec import max_blocks_spanned
from pagedllm.utils import cdiv


@pytest.mark.parametrize(
    "arch, overrides",
    [("mistral", {"sliding_window": 9}), ("qwen2", {"use_sliding_window": True, "sliding_window": 9, "max_window_layers": 1})],
    ids=["mistral", "qwen2-hybrid"],
)
def test_window_freeing_holds_the_window_and_keeps_the_tokens(tiny_models, arch, overrides):
    args = argparse.Namespace(prompt_len=10, output_len=40, block_size=4, max_num_batched_tokens=16,
                              kv_budget_mib=0.25, max_concurrent=4)
    row = measure(str(tiny_models(arch, **overrides)), arch, args)
    written = cdiv(10 + 40 - 1, 4)  # the last token's KV is never written
    # A decode step sees its window of 9 positions (3 blocks of 4 at most); the prompt took 3.
    window = max(cdiv(10, 4), max_blocks_spanned(9, 4))
    assert row["peak_blocks_kept"] == written * (1 if arch == "mistral" else 2)
    assert row["peak_blocks_freed"] == window + (0 if arch == "mistral" else written)
    assert row["same_tokens"] and row["saved_pct"] > 0
    assert row["fit_at_peak_freed"] > row["fit_at_peak_kept"]
    assert row["concurrent_preemptions"] == 0 and row["concurrent_peak_running"] == row["concurrent_seqs"]
