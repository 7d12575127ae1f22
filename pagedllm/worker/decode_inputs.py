"""The inputs of a step of decodes only (one token a sequence), and those of the next step
advanced in place.

Between two decode steps of the same sequences the inputs move by one: every position, context
length and KV slot is one further, and the block tables are the same but for the sequences that
entered a new block (one in 16 steps each at a block size of 16), had their last block copied on
write, or saw a block leave a sliding window. `DecodeInputs` keeps a CPU step's arrays and
metadata and, when the next batch is the same sequences one token further, adds one to them and
writes again only the rows whose tables changed; a batch whose sequences changed (one joining or
leaving) or whose longest table outgrows its array (built with SPARE_BLOCKS more columns) is built
anew. Either way the tensors are those `build_attention_metadata` gives, the block tables with
columns of block 0 past the longest (which no kernel reads) (tests/test_decode_inputs.py).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from pagedllm.attention import AttentionMetadata
from pagedllm.attention.cpu import decode_inputs_advancer
from pagedllm.core.scheduler_output import ScheduledSequence
from pagedllm.worker.block_tables import block_table_array

# Columns each block table of a decode batch is built with beyond its longest table: a sequence
# entering a new block writes its row in place rather than the whole step's inputs built anew
# (at a block size of 16: one rebuild in 256 steps of a growing batch, not one in 16).
SPARE_BLOCKS = 16


def decode_metadata(
    items: list[ScheduledSequence], block_size: int, device: torch.device, spare_blocks: int = 0
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """`build_attention_metadata` of a batch of decodes only (one token each, at its start
    position): the same tensors, with none of the general case's per-token expansion, but for
    `spare_blocks` more columns of each block table (block 0, as past a short table)."""
    num_seqs = len(items)
    positions = np.fromiter((item.start_position for item in items), dtype=np.int64, count=num_seqs)
    input_ids = np.fromiter((item.token_ids[0] for item in items), dtype=np.int64, count=num_seqs)
    rows, columns, offsets = np.arange(num_seqs), positions // block_size, positions % block_size
    seq_lens = positions + 1
    lens, starts, context = seq_lens.tolist(), _on(np.arange(num_seqs + 1, dtype=np.int64), device), _on(seq_lens, device)

    def group(tables: list[list[int | None]]) -> AttentionMetadata:
        array = block_table_array(tables, width=max(map(len, tables)) + spare_blocks)
        return AttentionMetadata(
            slot_mapping=_on(array[rows, columns].astype(np.int64) * block_size + offsets, device),
            query_start_loc=starts, seq_lens=context, block_tables=_on(array, device), query_lens=[1] * num_seqs,
            seq_lens_list=lens, block_size=block_size, num_decodes=num_seqs)

    metadata = group([item.block_table for item in items])
    metadata.other_groups = [group([item.other_block_tables[g] for item in items])
                             for g in range(len(items[0].other_block_tables))]
    return _on(input_ids, device), _on(positions, device), metadata


def _on(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device)


class DecodeInputs:
    """A CPU worker's decode-step inputs, kept for the next step (see the module's docstring).
    The tensors it returns are updated in place by the next `build`: nothing may keep them past
    its step (the model and sampler do not)."""

    _CPU = torch.device("cpu")

    def __init__(self, block_size: int, spare_blocks: int = SPARE_BLOCKS) -> None:
        self.block_size = block_size
        self.spare_blocks = spare_blocks
        self._seq_ids: list[int] = []
        self._starts: list[int] = []
        self._tables: list[list[list[int | None]]] = []  # copies: the scheduler's lists change
        self._inputs: tuple[torch.Tensor, torch.Tensor, AttentionMetadata] | None = None
        # Rows: positions, context lengths, each group's slots (the step's tensors are views of
        # them): all one further a step, in one addition.
        self._advancing = np.zeros((0, 0), dtype=np.int64)
        self._input_ids = np.zeros(0, dtype=np.int64)  # the input_ids tensor's array
        self._block_tables: list[np.ndarray] = []  # each group's, as the metadata holds them
        # The C step of `_advance` and its arrays' addresses (None without the kernel library:
        # numpy then); set by `build`.
        self._advance_kernel = decode_inputs_advancer()
        self._addresses: tuple[int, int, int] = (0, 0, 0)
        self.num_advanced = 0  # steps served by advancing the last one's inputs (tests read it)

    def build(self, items: list[ScheduledSequence]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) of a batch of decodes only."""
        changed = self._changed_rows(items) if self._inputs is not None else None
        if changed is not None and self._fits(items, changed):
            return self._advance(items, changed)
        input_ids, positions, metadata = decode_metadata(items, self.block_size, self._CPU, self.spare_blocks)
        groups = [metadata, *metadata.other_groups]
        # (On a CPU each tensor is a view of the array it was made from.)
        self._advancing = np.stack([positions.numpy(), metadata.seq_lens.numpy(), *(m.slot_mapping.numpy() for m in groups)])
        positions, seq_lens = torch.from_numpy(self._advancing[0]), torch.from_numpy(self._advancing[1])
        for g, group in enumerate(groups):
            group.seq_lens, group.slot_mapping = seq_lens, torch.from_numpy(self._advancing[2 + g])
        self._inputs = input_ids, positions, metadata
        self._input_ids = input_ids.numpy()
        self._addresses = (self._advancing.ctypes.data, self._advancing.size, self._input_ids.ctypes.data)
        self._block_tables = [m.block_tables.numpy() for m in groups]
        self._seq_ids = [item.seq_id for item in items]
        self._starts = [item.start_position for item in items]
        self._tables = [[list(table) for table in item.block_tables] for item in items]
        return self._inputs

    def _changed_rows(self, items: list[ScheduledSequence]) -> list[int] | None:
        """None unless `items` are the last step's sequences, in its order, each one token
        further; then the rows whose block tables changed or whose token starts a block (their
        slots are not the last one's + 1)."""
        if len(items) != len(self._seq_ids):
            return None
        block_size, changed = self.block_size, []
        for row, (item, seq_id, start, tables) in enumerate(zip(items, self._seq_ids, self._starts, self._tables)):
            if item.seq_id != seq_id or item.start_position != start + 1:
                return None
            if (item.start_position % block_size == 0 or item.block_table != tables[0]
                    or item.other_block_tables != tables[1:]):
                changed.append(row)
        return changed

    def _fits(self, items: list[ScheduledSequence], changed: list[int]) -> bool:
        """Whether the arrays still hold the longest table of each group (else the step is built
        anew): only a changed table can outgrow them."""
        if not changed:
            return True
        return all(array.shape[1] >= max(len(item.block_tables[g]) for item in items)
                   for g, array in enumerate(self._block_tables))

    def _advance(self, items: list[ScheduledSequence], changed: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        inputs, self._inputs = self._inputs, None  # (if this fails part way, the next step builds anew)
        input_ids, _, metadata = inputs
        ids = [item.token_ids[0] for item in items]
        if self._advance_kernel is not None:  # (no numpy in a decode step: see the kernel's comment)
            advancing, count, input_ids_address = self._addresses
            self._advance_kernel(advancing, count, input_ids_address, (ctypes.c_int64 * len(ids))(*ids), len(ids))
        else:
            self._advancing += 1
            self._input_ids[:] = ids
        self._starts = [start + 1 for start in self._starts]
        block_size = self.block_size
        for row in changed:  # its tables written again, its slots looked up
            slots = self._advancing[2:]
            item = items[row]
            position = item.start_position
            tables = item.block_tables
            for table, array, slot in zip(tables, self._block_tables, slots):
                array[row] = block_table_array([table], width=array.shape[1])[0]
                slot[row] = int(array[row, position // block_size]) * block_size + position % block_size
            self._tables[row] = [list(table) for table in tables]
        lens = [start + 1 for start in self._starts]  # (the context lengths, as the array holds them)
        for group in (metadata, *metadata.other_groups):
            group.seq_lens_list = lens
            group.backend_plan = None  # derived from the step's lengths: the backend plans again
        self.num_advanced += 1
        self._inputs = inputs
        return inputs
