"""CUDA graphs of decode and verify steps: the forward pass of a batch whose sequences each
compute one token (decoding) or their last token and k proposed ones (speculative decoding's
verification), captured once per bucket at start-up and replayed, so a step costs one graph
launch instead of a few hundred kernel launches from Python.

A bucket is (batch size, query width q): every sequence of the batch gets q rows. Widths are 1
(decode steps) and, with speculation of up to k tokens, the powers of two below 1 + k and 1 + k
itself (`query_widths`); a step takes the smallest width that holds its longest query. Buckets
of q > 1 are those batch sizes whose size * q stays within `max_tokens`, so capture time and
memory stay small.

A graph replays fixed kernels on fixed addresses, so everything a step reads lives in static
buffers sized for the largest bucket, refilled before each replay:
- token ids, positions, slots and one row of the block table per sequence (as wide as the
  longest context), in each KV cache group, and the Triton backend's work items (`decode_items`);
- sequence i owns rows [i * q, (i + 1) * q) and its n_i tokens are the last n_i of them; the rows
  before are padding: token 0 at position 0, slot -1 (the KV write skips it), and no work item
  covers them (the work item of sequence i is its n_i tokens), so their outputs are never read;
- a batch of n sequences runs in the smallest bucket >= n; its sequences past n are padding too:
  slot -1 and a work item of no token (attention reads and writes nothing);
- a bucket of q > 1 has the Triton kernel take q tokens of a GQA group per program
  (`static_decode_plan(tokens_per_item=q)`);
- the flash-decoding split is fixed per bucket and group, for the longest context or the
  group's window (partitions past a shorter one see no key).

`run` returns all q rows of each sequence, so the caller finds its tokens as in an eager step
whose query lengths are all q (the last 1 + k rows of each).

Only the model's forward pass is captured; logits and sampling run after it, eagerly, on the
rows that are real. Prompt steps, steps asking for prompt log-probabilities, batches past the
largest bucket of their width and contexts past `max_model_len` run eagerly.
`enforce_eager=True` turns graphs off.

On a CPU (tests) `capture=False` runs the same static-buffer forward eagerly instead of a
replay, so the padding and the fixed split are checked by the Triton interpreter.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import numpy as np
import torch

from pagedllm.attention import AttentionMetadata
from pagedllm.attention.triton_backend import decode_items
from pagedllm.config import GiB
from pagedllm.core.scheduler_output import ScheduledSequence
from pagedllm.utils import cdiv
from pagedllm.worker.block_tables import block_table_array

logger = logging.getLogger("pagedllm")

# Batch sizes captured (as vLLM: dense at small sizes, where padding costs most relatively).
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)
# The most rows (batch size * query width) of a verify step's graph.
MAX_GRAPH_TOKENS = 1024


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The buckets needed for batches of up to `max_num_seqs` sequences (at most 256)."""
    sizes = [size for size in CAPTURE_SIZES if size < max_num_seqs]
    sizes.append(next((size for size in CAPTURE_SIZES if size >= max_num_seqs), CAPTURE_SIZES[-1]))
    return tuple(sizes)


def query_widths(num_speculative_tokens: int | None) -> tuple[int, ...]:
    """The query widths captured: 1, and with speculation of up to k tokens the powers of two
    below 1 + k and 1 + k itself (the widest query, a full proposal, is common: padding it to the
    next power of two would add up to k rows to every sequence of the step)."""
    widest = 1 + (num_speculative_tokens or 0)
    widths = [1 << i for i in range(widest.bit_length()) if 1 << i < widest]
    return (*widths, widest)


def graph_buckets(max_num_seqs: int, num_speculative_tokens: int | None = None,
                  max_tokens: int = MAX_GRAPH_TOKENS) -> dict[int, tuple[int, ...]]:
    """Query width -> the batch sizes captured for it: every decode size, and for a width
    q > 1 those whose size * q is within `max_tokens` (a width with none is left out)."""
    sizes = capture_sizes(max_num_seqs)
    buckets = {1: sizes}
    for width in query_widths(num_speculative_tokens)[1:]:
        fitting = tuple(size for size in sizes if size * width <= max_tokens)
        if fitting:
            buckets[width] = fitting
    return buckets


class DecodeGraphs:
    def __init__(self, model, backend, block_size: int, max_model_len: int, max_num_seqs: int,
                 device: torch.device, capture: bool = True, num_speculative_tokens: int | None = None,
                 max_tokens: int = MAX_GRAPH_TOKENS) -> None:
        self.model = model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.capture_graphs = capture
        self.buckets = graph_buckets(max_num_seqs, num_speculative_tokens, max_tokens)
        self.sizes = self.buckets[1]  # the decode steps' batch sizes
        self.keys = [(size, width) for width, sizes in self.buckets.items() for size in sizes]
        largest = self.sizes[-1]
        max_rows = max(size * width for size, width in self.keys)
        self.max_blocks = cdiv(max_model_len, block_size)
        self.input_ids = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.long, device=device)
        self.items = torch.from_numpy(decode_items(np.zeros(0, dtype=np.int64), largest)).to(device)
        attn = model.attention_layers[0]
        group = attn.num_heads // attn.num_kv_heads
        # Each KV cache group's window (its layers share it), and slots and tables of its own.
        windows = {layer.kv_cache_group: layer.sliding_window for layer in model.attention_layers}
        self.group_windows = [windows[g] for g in range(len(windows))]
        self.slot_mappings = [torch.full((max_rows,), -1, dtype=torch.long, device=device) for _ in windows]
        self.block_tables = [torch.zeros((largest, self.max_blocks), dtype=torch.int32, device=device) for _ in windows]
        self.metadata: dict[tuple[int, int], AttentionMetadata] = {}
        for size, width in self.keys:
            rows = size * width
            query_start_loc = torch.arange(0, rows + 1, width, dtype=torch.long, device=device)
            groups = [
                AttentionMetadata(
                    slot_mapping=slots[:rows], query_start_loc=query_start_loc, seq_lens=self.seq_lens[:size],
                    block_tables=tables[:size], query_lens=[width] * size, seq_lens_list=[max_model_len] * size,
                    block_size=block_size, num_decodes=size if width == 1 else 0,
                    backend_plan=backend.static_decode_plan(self.items[:size], tables[:size], group, attn.head_dim,
                                                            attn.num_kv_heads, max_model_len, window, width),
                )
                for slots, tables, window in zip(self.slot_mappings, self.block_tables, self.group_windows)
            ]
            groups[0].other_groups = groups[1:]
            self.metadata[size, width] = groups[0]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.replays = 0  # steps run through the static buffers (graphs, or their CPU stand-in)
        self.replays_by_width: Counter[int] = Counter()  # of them, by query width

    def bucket(self, num_seqs: int, width: int = 1) -> int:
        return next(size for size in self.buckets[width] if size >= num_seqs)

    def width(self, items: list[ScheduledSequence]) -> int | None:
        """The smallest captured query width that holds the step's longest query, or None."""
        longest = max(len(item.token_ids) for item in items)
        return next((width for width in self.buckets if width >= longest), None)

    def applies(self, items: list[ScheduledSequence]) -> bool:
        """Whether this step can run through the buffers: every sequence decodes one token or
        verifies proposed ones after its last (no prompt chunk, no prompt log-probabilities), a
        bucket of the step's width holds the batch, and every block table fits the buffer."""
        if not all(len(item.token_ids) == 1 + len(item.draft_token_ids) and not item.prompt_logprob_targets
                   for item in items):
            return False
        width = self.width(items)
        return (
            width is not None
            and len(items) <= self.buckets[width][-1]
            and all(len(item.block_table) <= self.max_blocks for item in items)
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, the most rows first, sharing one memory pool (each graph's
        activations are freed for the next). A warm-up run before each capture compiles the
        Triton kernels for its shapes (compiling cannot happen inside a capture). The buffers
        hold padding only, so neither run writes the KV cache."""
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        for key in sorted(self.keys, key=lambda key: (key[0] * key[1], key[1]), reverse=True):
            self._forward(*key)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self._forward(*key)
            self.graphs[key] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "CUDA graphs: %d buckets (batch sizes by query width: %s) captured in %.1f s, %.2f GiB",
            len(self.keys),
            "; ".join(f"q={width}: {', '.join(map(str, sizes))}" for width, sizes in self.buckets.items()),
            time.perf_counter() - start, (torch.cuda.memory_reserved(self.device) - reserved) / GiB,
        )

    def _forward(self, size: int, width: int) -> torch.Tensor:
        rows = size * width
        return self.model(self.input_ids[:rows], self.positions[:rows], self.metadata[size, width])

    def run(self, items: list[ScheduledSequence]) -> tuple[torch.Tensor, list[int]]:
        """The hidden states of a step's sequences, q rows each ([len(items) * q, hidden]; a
        sequence's tokens are its last rows), and the query lengths to read them by ([q] * len(items))."""
        num_seqs = len(items)
        width = self.width(items)
        size = self.bucket(num_seqs, width)
        rows = size * width
        query_lens = np.fromiter((len(item.token_ids) for item in items), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((item.start_position for item in items), dtype=np.int64, count=num_seqs)
        # Each real token: its sequence, its place in the query, its row and its position.
        seq_index = np.repeat(np.arange(num_seqs), query_lens)
        offset = np.arange(len(seq_index)) - np.repeat(np.cumsum(query_lens) - query_lens, query_lens)
        token_rows = (seq_index + 1) * width - query_lens[seq_index] + offset
        token_positions = starts[seq_index] + offset
        fills = []
        for group, (slot_buffer, table_buffer) in enumerate(zip(self.slot_mappings, self.block_tables)):
            block_tables = block_table_array([item.block_tables[group] for item in items], size, self.max_blocks)
            slots = np.full(rows, -1, dtype=np.int64)
            slots[token_rows] = (
                block_tables[seq_index, token_positions // self.block_size].astype(np.int64) * self.block_size
                + token_positions % self.block_size
            )
            fills += [(slot_buffer, slots), (table_buffer, block_tables)]
        input_ids = np.zeros(rows, dtype=np.int64)
        input_ids[token_rows] = [t for item in items for t in item.token_ids]
        positions = np.zeros(rows, dtype=np.int64)
        positions[token_rows] = token_positions
        seq_lens = np.zeros(size, dtype=np.int64)
        seq_lens[:num_seqs] = starts + query_lens
        for buffer, values in (
            (self.input_ids, input_ids), (self.positions, positions), (self.seq_lens, seq_lens),
            (self.items, decode_items(starts + query_lens, size, query_lens, width)), *fills,
        ):
            buffer[: len(values)].copy_(torch.from_numpy(values), non_blocking=True)
        self.replays += 1
        self.replays_by_width[width] += 1
        if self.capture_graphs:
            self.graphs[size, width].replay()
            hidden = self.outputs[size, width]
        else:
            hidden = self._forward(size, width)
        return hidden[: num_seqs * width], [width] * num_seqs
