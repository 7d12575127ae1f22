"""The Triton PagedAttention backend: GPU kernels that read keys and values in place through the
block tables (pagedllm/kernels/triton_attention.py has the scheme).

Once per step the backend cuts the batch into work items (a decode is one item; a prompt chunk
is cut into items of a few tokens) and chooses how many partitions each item's context is split
into (flash-decoding), from how many programs the step would otherwise run against how many the
GPU keeps busy. Every layer then runs the same two launches: the KV write and the attention.

On a CPU the kernels run in Triton's interpreter (numpy, one program after another): slow, and
meant for tests, which check every kernel that way on machines without a GPU. Triton is
imported only when this backend is built.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from pagedllm.attention.backend import AttentionBackend, AttentionMetadata
from pagedllm.attention.triton_tuning import LaunchConfig, TuningTable, load_table
from pagedllm.utils import cdiv

logger = logging.getLogger("pagedllm")

BLOCK_SIZES = (8, 16, 32, 64, 128)
# Query rows (token, head of a group) of one program: decode-only steps have one token per
# item, so a small tile; prompt tokens share each key tile between more rows.
DECODE_BLOCK_M = 16
PROMPT_BLOCK_M = 64
# Flash-decoding: programs per streaming multiprocessor that keep a GPU busy, the most
# partitions of one context, and the fewest tokens worth a partition of their own.
PROGRAMS_PER_SM = 4
MAX_PARTITIONS = 32
MIN_PARTITION_TOKENS = 256


def check_block_size(block_size: int) -> None:
    if block_size not in BLOCK_SIZES:
        raise ValueError(
            f"The triton attention backend supports block sizes {', '.join(map(str, BLOCK_SIZES))}, "
            f"not {block_size}; set block_size to one of them, or use another attention_backend."
        )


def load_kernels(device: torch.device) -> ModuleType:
    """The kernel module, compiled for a GPU, or run by Triton's interpreter for CPU tensors.

    Triton decides once per process, when it is imported: its own helpers (`tl.max`, `tl.sum`,
    ...) are kernels too, interpreted only if TRITON_INTERPRET=1 was set by then. So for a CPU
    the variable is set here when Triton is not imported yet (child processes inherit it), and a
    process that already imported Triton for a GPU is refused with what to change.
    """
    if device.type == "cpu" and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    from pagedllm.kernels import triton_attention

    if device.type == "cpu" and not triton_attention.INTERPRETED:
        raise RuntimeError(
            "The triton attention backend runs on a CPU only in Triton's interpreter, but Triton was imported in "
            "this process without it. Set TRITON_INTERPRET=1 in the environment before starting (it is slow: "
            "for tests), or use attention_backend='cpu'."
        )
    if device.type == "cpu":
        _warn_interpreted()
    return triton_attention


@functools.cache
def _warn_interpreted() -> None:
    logger.warning("The triton attention backend on a CPU runs in Triton's interpreter: slow, for tests.")


@functools.cache
def _target_programs(device: torch.device) -> int:
    """Programs that keep `device` busy: below this, contexts are split (never on a CPU, where
    the interpreter runs one program at a time)."""
    if device.type != "cuda":
        return 1
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_partitions(num_items: int, num_kv_heads: int, max_seq_len: int, target_programs: int) -> int:
    """Partitions per context (a power of two): enough that num_items * num_kv_heads programs
    become at least `target_programs`, but no partition under MIN_PARTITION_TOKENS tokens."""
    num_partitions = 1
    while (
        num_items * num_kv_heads * num_partitions < target_programs
        and num_partitions < MAX_PARTITIONS
        and max_seq_len >= 2 * num_partitions * MIN_PARTITION_TOKENS
    ):
        num_partitions *= 2
    return num_partitions


@dataclass
class _Plan:
    """One step's work items and launch shape, built once and shared by every layer."""

    items: torch.Tensor  # [num_items, 4] int32 on the device: sequence, first token, tokens, first position
    block_m: int
    tile_n: int
    num_partitions: int
    block_tables: torch.Tensor  # int32, rows contiguous
    sliding_window: int | None = None  # of the layers it is for (the split is sized to it)
    num_warps: int | None = None  # None: Triton's defaults
    num_stages: int | None = None


def visible_context(max_seq_len: int, sliding_window: int | None, tokens_per_item: int) -> int:
    """The most keys one item reads: its context, or its tokens' windows."""
    if sliding_window is None:
        return max_seq_len
    return min(max_seq_len, sliding_window - 1 + tokens_per_item)


def _plan(metadata: AttentionMetadata, group: int, head_dim: int, num_kv_heads: int, device: torch.device,
          num_partitions: int | None, sliding_window: int | None = None, launch: LaunchConfig | None = None) -> _Plan:
    query_lens = np.asarray(metadata.query_lens, dtype=np.int64)
    seq_lens = np.asarray(metadata.seq_lens_list, dtype=np.int64)
    decode_only = bool((query_lens == 1).all())
    block_m = _block_m(decode_only, group)
    tokens_per_item = block_m // group
    starts = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=starts[1:])
    # Each sequence's query tokens cut into runs of tokens_per_item.
    per_seq = cdiv(query_lens, tokens_per_item)
    item_seq = np.repeat(np.arange(len(query_lens)), per_seq)
    index_in_seq = np.arange(int(per_seq.sum())) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    offset = index_in_seq * tokens_per_item
    items = np.stack(
        [
            item_seq,
            starts[item_seq] + offset,
            np.minimum(tokens_per_item, query_lens[item_seq] - offset),
            (seq_lens - query_lens)[item_seq] + offset,
        ],
        axis=1,
    ).astype(np.int32)
    visible = visible_context(metadata.max_seq_len, sliding_window, tokens_per_item)
    if launch is not None and num_partitions is None:
        num_partitions = launch.num_partitions
    if num_partitions is None:
        num_partitions = choose_num_partitions(len(items), num_kv_heads, visible, _target_programs(device))
    block_tables = metadata.block_tables
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        block_tables = block_tables.to(torch.int32).contiguous()
    return _Plan(
        items=torch.from_numpy(items).to(device),
        block_m=block_m,
        tile_n=launch.tile_n if launch is not None else _tile_n(head_dim),
        num_partitions=num_partitions,
        block_tables=block_tables.to(device),
        sliding_window=sliding_window,
        num_warps=launch.num_warps if launch is not None else None,
        num_stages=launch.num_stages if launch is not None else None,
    )


def _block_m(decode_only: bool, group: int, tokens_per_item: int = 1) -> int:
    """Query rows of a program: at least `tokens_per_item` tokens of a GQA group, a power of two."""
    return max(DECODE_BLOCK_M if decode_only else PROMPT_BLOCK_M, 1 << (tokens_per_item * group - 1).bit_length())


def _tile_n(head_dim: int) -> int:
    return 64 if head_dim <= 128 else 32


def decode_items(seq_lens: np.ndarray, size: int, query_lens: np.ndarray | None = None, width: int = 1) -> np.ndarray:
    """The work items, one per sequence, of a step whose len(seq_lens) sequences have
    `query_lens` tokens each (default 1: decodes), at most `width`: sequence i owns flat tokens
    [i * width, (i + 1) * width) and its tokens are the last of them (the rows before are
    padding). Padded to `size` rows of empty items (no token: nothing read or written)."""
    num_seqs = len(seq_lens)
    if query_lens is None:
        query_lens = np.ones(num_seqs, dtype=np.int64)
    items = np.zeros((size, 4), dtype=np.int32)
    items[:, 0] = np.arange(size)
    items[:, 1] = np.arange(size) * width
    items[:num_seqs, 1] += width - query_lens
    items[:num_seqs, 2] = query_lens
    items[:num_seqs, 3] = seq_lens - query_lens
    return items


class TritonAttentionBackend(AttentionBackend):
    """Pools are [num_blocks, num_kv_heads, block_size, head_dim]: a block's keys of one KV head
    lie side by side, so a program reads them as one contiguous run.

    `num_partitions` forces the flash-decoding split (tests, benchmarks); by default each step
    chooses it (`choose_num_partitions`). `launch` forces the whole launch shape (the autotuning
    sweep's candidates); else `tuning` (default: the measured table of this GPU, see
    `triton_tuning`) chooses per step where it has an entry, and the built-in heuristics where not.
    """

    name = "triton"
    block_dim = 0

    def __init__(self, device: torch.device, num_partitions: int | None = None, launch: LaunchConfig | None = None,
                 tuning: TuningTable | None = None) -> None:
        if num_partitions is not None and (num_partitions < 1 or num_partitions & (num_partitions - 1)):
            raise ValueError(f"num_partitions must be a power of two, got {num_partitions}.")
        device = torch.device(device)
        self.kernels = load_kernels(device)
        self.num_partitions = num_partitions
        self.launch = launch.validate("launch", MAX_PARTITIONS) if launch is not None else None
        if tuning is None and launch is None and device.type == "cuda" and torch.cuda.is_available():
            tuning = load_table(torch.cuda.get_device_name(device), MAX_PARTITIONS)
            if tuning is not None:
                logger.info("Triton attention: %d tuned launch shapes from %s", len(tuning), tuning.source)
        self.tuning = tuning

    def launch_for(self, decode_only: bool, head_dim: int, group: int, context: int, batch: int) -> LaunchConfig | None:
        """The forced launch shape, else the tuning table's for this step, else None (heuristics)."""
        if self.launch is not None or self.tuning is None:
            return self.launch
        return self.tuning.lookup("decode" if decode_only else "prompt", head_dim, group, context, batch)

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        check_block_size(block_size)
        return (num_blocks, num_kv_heads, block_size, head_dim)

    def static_decode_plan(self, items: torch.Tensor, block_tables: torch.Tensor, group: int, head_dim: int,
                           num_kv_heads: int, max_seq_len: int, sliding_window: int | None = None,
                           tokens_per_item: int = 1) -> _Plan:
        """The plan of a decode step over fixed buffers (a CUDA graph's): `items` ([size, 4] int32,
        filled by `decode_items` before each replay) and `block_tables` ([size, max blocks] int32),
        for layers of `sliding_window`. The flash-decoding split is fixed too, chosen for contexts
        of `max_seq_len` (or the window): partitions past a shorter context see no key and weigh
        nothing in the merge. `tokens_per_item` > 1 (steps verifying proposed tokens): each item
        holds up to that many tokens of its sequence, so a program's rows are that many tokens of
        a GQA group, and the launch is tuned as a prompt step's of size * tokens_per_item tokens."""
        decode_only = tokens_per_item == 1
        visible = visible_context(max_seq_len, sliding_window, tokens_per_item)
        launch = self.launch_for(decode_only, head_dim, group, visible, items.shape[0] * tokens_per_item)
        num_partitions = self.num_partitions or (launch.num_partitions if launch is not None else None)
        num_partitions = num_partitions or choose_num_partitions(
            items.shape[0], num_kv_heads, visible, _target_programs(items.device)
        )
        return _Plan(items=items, block_m=_block_m(True, group, tokens_per_item),
                     tile_n=launch.tile_n if launch is not None else _tile_n(head_dim),
                     num_partitions=num_partitions, block_tables=block_tables, sliding_window=sliding_window,
                     num_warps=launch.num_warps if launch is not None else None,
                     num_stages=launch.num_stages if launch is not None else None)

    def write_kv(self, key, value, key_cache, value_cache, metadata: AttentionMetadata) -> None:
        self.kernels.write_kv(key, value, key_cache, value_cache, metadata.slot_mapping)

    def forward(self, query, key, value, key_cache, value_cache, metadata: AttentionMetadata, scale: float,
                sliding_window: int | None = None, logits_soft_cap: float | None = None):
        num_heads, head_dim = query.shape[1:]
        num_kv_heads = key_cache.shape[1]
        group = num_heads // num_kv_heads
        plan = metadata.backend_plan
        # Built by the first layer of the step (of its KV cache group, whose layers share the window).
        if plan is None or plan.sliding_window != sliding_window:
            decode_only = all(n == 1 for n in metadata.query_lens)
            batch = len(metadata.query_lens) if decode_only else sum(metadata.query_lens)
            context = visible_context(metadata.max_seq_len, sliding_window, 1)
            launch = self.launch_for(decode_only, head_dim, group, context, batch)
            plan = _plan(metadata, group, head_dim, num_kv_heads, query.device, self.num_partitions, sliding_window,
                         launch)
            metadata.backend_plan = plan
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        self.kernels.paged_attention(
            out, query, key_cache, value_cache, plan.block_tables, plan.items, scale,
            plan.block_m, plan.tile_n, plan.num_partitions, sliding_window, logits_soft_cap,
            num_warps=plan.num_warps, num_stages=plan.num_stages,
        )
        return out
