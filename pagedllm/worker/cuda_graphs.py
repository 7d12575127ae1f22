"""CUDA graphs of decode steps: the forward pass of a decode-only batch, captured once per
batch-size bucket at start-up and replayed, so a step costs one graph launch instead of a few
hundred kernel launches from Python.

A graph replays fixed kernels on fixed addresses, so everything a decode step reads lives in
static buffers sized for the largest bucket, refilled before each replay:
- token ids, positions, slots and one row of the block table per sequence (as wide as the
  longest context), in each KV cache group, and the Triton backend's work items (`decode_items`);
- a batch of n sequences runs in the smallest bucket >= n; its rows past n are padding: slot -1
  (the KV write skips it), a work item of no token (attention reads and writes nothing), and
  their outputs are never read;
- the flash-decoding split is fixed per bucket and group, for the longest context or the
  group's window (partitions past a shorter one see no key).

Only the model's forward pass is captured; logits and sampling run after it, eagerly, on the
rows that are real. Prompt steps, batches past the largest bucket and contexts past
`max_model_len` run eagerly. `enforce_eager=True` turns graphs off.

On a CPU (tests) `capture=False` runs the same static-buffer forward eagerly instead of a
replay, so the padding and the fixed split are checked by the Triton interpreter.
"""

from __future__ import annotations

import logging
import time

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


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The buckets needed for batches of up to `max_num_seqs` sequences (at most 256)."""
    sizes = [size for size in CAPTURE_SIZES if size < max_num_seqs]
    sizes.append(next((size for size in CAPTURE_SIZES if size >= max_num_seqs), CAPTURE_SIZES[-1]))
    return tuple(sizes)


class DecodeGraphs:
    def __init__(self, model, backend, block_size: int, max_model_len: int, max_num_seqs: int,
                 device: torch.device, capture: bool = True) -> None:
        self.model = model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.capture_graphs = capture
        self.sizes = capture_sizes(max_num_seqs)
        largest = self.sizes[-1]
        self.max_blocks = cdiv(max_model_len, block_size)
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.long, device=device)
        self.items = torch.from_numpy(decode_items(np.zeros(0, dtype=np.int64), largest)).to(device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.long, device=device)
        attn = model.attention_layers[0]
        group = attn.num_heads // attn.num_kv_heads
        # Each KV cache group's window (its layers share it), and slots and tables of its own.
        windows = {layer.kv_cache_group: layer.sliding_window for layer in model.attention_layers}
        self.group_windows = [windows[g] for g in range(len(windows))]
        self.slot_mappings = [torch.full((largest,), -1, dtype=torch.long, device=device) for _ in windows]
        self.block_tables = [torch.zeros((largest, self.max_blocks), dtype=torch.int32, device=device) for _ in windows]
        self.metadata: dict[int, AttentionMetadata] = {}
        for size in self.sizes:
            groups = [
                AttentionMetadata(
                    slot_mapping=slots[:size], query_start_loc=self.query_start_loc[: size + 1],
                    seq_lens=self.seq_lens[:size], block_tables=tables[:size], query_lens=[1] * size,
                    seq_lens_list=[max_model_len] * size, block_size=block_size, num_decodes=size,
                    backend_plan=backend.static_decode_plan(self.items[:size], tables[:size], group, attn.head_dim,
                                                            attn.num_kv_heads, max_model_len, window),
                )
                for slots, tables, window in zip(self.slot_mappings, self.block_tables, self.group_windows)
            ]
            groups[0].other_groups = groups[1:]
            self.metadata[size] = groups[0]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # decode steps run through the static buffers (graphs, or their CPU stand-in)

    def bucket(self, num_seqs: int) -> int:
        return next(size for size in self.sizes if size >= num_seqs)

    def applies(self, items: list[ScheduledSequence]) -> bool:
        """Whether this step can run through the buffers: one token per sequence, a bucket for
        the batch, and every block table within the buffer's width."""
        return (
            len(items) <= self.sizes[-1]
            and all(len(item.token_ids) == 1 for item in items)
            and all(len(item.block_table) <= self.max_blocks for item in items)
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool (each graph's
        activations are freed for the next). A warm-up run before each capture compiles the
        Triton kernels for its shapes (compiling cannot happen inside a capture). The buffers
        hold padding only, so neither run writes the KV cache."""
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._forward(size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "CUDA graphs: %d decode batch sizes (%s) captured in %.1f s, %.2f GiB",
            len(self.sizes), ", ".join(map(str, self.sizes)), time.perf_counter() - start,
            (torch.cuda.memory_reserved(self.device) - reserved) / GiB,
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.metadata[size])

    def run(self, items: list[ScheduledSequence]) -> torch.Tensor:
        """The hidden states of a decode step's sequences, [len(items), hidden]."""
        num_seqs = len(items)
        size = self.bucket(num_seqs)
        positions = np.fromiter((item.start_position for item in items), dtype=np.int64, count=num_seqs)
        fills = []
        for group, (slot_buffer, table_buffer) in enumerate(zip(self.slot_mappings, self.block_tables)):
            block_tables = block_table_array([item.block_tables[group] for item in items], size, self.max_blocks)
            slots = np.full(size, -1, dtype=np.int64)
            slots[:num_seqs] = (
                block_tables[np.arange(num_seqs), positions // self.block_size].astype(np.int64) * self.block_size
                + positions % self.block_size
            )
            fills += [(slot_buffer, slots), (table_buffer, block_tables)]
        input_ids = np.zeros(size, dtype=np.int64)
        input_ids[:num_seqs] = [item.token_ids[0] for item in items]
        padded_positions = np.zeros(size, dtype=np.int64)
        padded_positions[:num_seqs] = positions
        seq_lens = np.zeros(size, dtype=np.int64)
        seq_lens[:num_seqs] = positions + 1
        for buffer, values in (
            (self.input_ids, input_ids), (self.positions, padded_positions), (self.seq_lens, seq_lens),
            (self.items, decode_items(positions + 1, size)), *fills,
        ):
            buffer[:size].copy_(torch.from_numpy(values), non_blocking=True)
        self.replays += 1
        if self.capture_graphs:
            self.graphs[size].replay()
            return self.outputs[size][:num_seqs]
        return self._forward(size)[:num_seqs]
