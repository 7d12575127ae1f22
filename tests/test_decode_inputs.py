"""A decode step's inputs advanced in place from the last step's (worker/decode_inputs.py): every
tensor and list equal to the inputs built anew, advanced only when the batch follows the last one
(the rows whose tables changed rewritten), and the engine's tokens and log-probabilities
unchanged by it."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pagedllm.core.scheduler_output import ScheduledSequence
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.decode_inputs import DecodeInputs, decode_metadata

BLOCK = 16
CPU = torch.device("cpu")


def _same_inputs(got, want) -> None:
    (ids, positions, metadata), (want_ids, want_positions, want_metadata) = got, want
    assert torch.equal(ids, want_ids) and torch.equal(positions, want_positions)
    assert len(metadata.other_groups) == len(want_metadata.other_groups)
    for group in range(len(metadata.other_groups) + 1):
        a, b = metadata.for_group(group), want_metadata.for_group(group)
        for field in dataclasses.fields(a):
            if field.name in ("other_groups", "backend_plan"):
                continue
            x, y = getattr(a, field.name), getattr(b, field.name)
            if field.name == "block_tables":  # (kept wider: the columns past the longest table are block 0)
                assert x.shape[1] >= y.shape[1] and not x[:, y.shape[1]:].any()
                x = x[:, : y.shape[1]]
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and torch.equal(x, y), field.name
            else:
                assert x == y, field.name


class _Seq:
    """A decoding sequence as the scheduler sees it: its position and a table per group (the
    later groups sliding-window ones, whose leading blocks are freed as the window moves)."""

    def __init__(self, seq_id: int, position: int, num_groups: int, rng: random.Random, window: int = 40):
        self.seq_id, self.position, self.rng, self.window = seq_id, position, rng, window
        self.tables = [[rng.randrange(1, 1000) for _ in range(position // BLOCK + 1)] for _ in range(num_groups)]

    def step(self) -> None:
        self.position += 1
        for g, table in enumerate(self.tables):
            if self.position // BLOCK >= len(table):
                table.append(self.rng.randrange(1, 1000))
            if g:  # blocks wholly before the window: back in the pool
                for b in range(max(0, (self.position - self.window + 1) // BLOCK)):
                    table[b] = None

    def item(self) -> ScheduledSequence:
        return ScheduledSequence(seq_id=self.seq_id, request_id=f"r{self.seq_id}", token_ids=[self.rng.randrange(50000)],
                                 start_position=self.position, block_table=self.tables[0],
                                 sampling_params=SamplingParams(temperature=0), other_block_tables=self.tables[1:])


@pytest.mark.parametrize("advance,spare_blocks", [("kernel", 16), ("numpy", 16), ("kernel", 0), ("kernel", 1)])
def test_each_step_equals_its_inputs_built_anew(advance, spare_blocks):
    rng = random.Random(0)
    inputs = DecodeInputs(BLOCK, spare_blocks)
    assert inputs._advance_kernel is not None  # (the kernels are built wherever the tests run)
    if advance == "numpy":  # the way without the kernel library
        inputs._advance_kernel = None
    seqs = [_Seq(0, 20, 3, rng), _Seq(1, 45, 3, rng), _Seq(2, 3, 3, rng)]
    advanced = built = 0
    for step in range(80):
        if step == 30:
            seqs.pop(1)  # one finishes
        if step == 50:
            seqs.append(_Seq(7, 60, 3, rng))  # one joins
        if step == 65:  # copy-on-write: the last block replaced, its length unchanged
            seqs[0].tables[0][-1] = 1001
        items = [s.item() for s in seqs]
        before = inputs.num_advanced
        widest = [max(len(item.block_tables[g]) for item in items) for g in range(3)]
        got = inputs.build(items)
        _same_inputs(got, decode_metadata(items, BLOCK, CPU))
        if inputs.num_advanced > before:
            advanced += 1
            assert step not in (0, 30, 50)  # these changed the batch: built anew
            assert all(widest[g] <= array.shape[1] <= widest[g] + spare_blocks
                       for g, array in enumerate(inputs._block_tables))
        else:
            built += 1
        for s in seqs:
            s.step()
    # A step is built anew when the batch changes or a table outgrows the arrays (without spare
    # columns: the widest sequence entering a new block); rows entering a block, copied on write
    # or leaving a window are rewritten in place. In 80 steps the tables grow by 5 blocks: with
    # one spare column, two of those growths outgrow the arrays.
    assert advanced > 60
    assert built == {16: 3, 1: 5, 0: 8}[spare_blocks]


def test_the_plan_is_made_again_for_an_advanced_step():
    rng = random.Random(1)
    inputs = DecodeInputs(BLOCK)
    seq = _Seq(0, 5, 1, rng)
    _, _, metadata = inputs.build([seq.item()])
    metadata.backend_plan = "last step's plan"
    seq.step()
    _, _, advanced = inputs.build([seq.item()])
    assert inputs.num_advanced == 1 and advanced is metadata and advanced.backend_plan is None
    assert advanced.seq_lens_list == [7] and advanced.slot_mapping.tolist() == [seq.tables[0][0] * BLOCK + 6]


def test_a_sequence_seen_again_at_another_position_is_built_anew():
    """Same sequence ids and tables, but not one position further (a recomputed sequence back
    at the same blocks): nothing is advanced."""
    rng = random.Random(2)
    inputs = DecodeInputs(BLOCK)
    seq = _Seq(0, 5, 2, rng)
    inputs.build([seq.item()])
    item = dataclasses.replace(seq.item(), start_position=7)
    got = inputs.build([item])
    assert inputs.num_advanced == 0
    _same_inputs(got, decode_metadata([item], BLOCK, CPU))


def test_a_step_into_a_block_allocated_ahead_looks_its_slot_up():
    """A table that already holds the next block (slots reserved ahead, as for proposed tokens):
    the step that enters it keeps the same table, and its slot is in that block, not the last
    slot + 1."""
    inputs = DecodeInputs(BLOCK)
    table = [11, 12]
    items = [dataclasses.replace(_Seq(0, 0, 1, random.Random(3)).item(), start_position=p, block_table=table)
             for p in (14, 15, 16)]
    for item in items:
        got = inputs.build([item])
        _same_inputs(got, decode_metadata([item], BLOCK, CPU))
    assert inputs.num_advanced == 2 and got[2].slot_mapping.tolist() == [12 * BLOCK]


def test_engine_tokens_and_logprobs_are_those_of_inputs_built_every_step(smollm_llm):
    runner = smollm_llm.llm_engine.executor.worker.runner
    assert runner.decode_inputs is not None
    prompts = ["The capital of France is", "Water boils at", "def fibonacci(n):"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (40, 25, 33)]

    def run():
        outs = smollm_llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    before = runner.decode_inputs.num_advanced
    advanced = run()
    assert runner.decode_inputs.num_advanced - before > 30
    kept, runner.decode_inputs = runner.decode_inputs, None
    try:
        rebuilt = run()
    finally:
        runner.decode_inputs = kept
    assert advanced == rebuilt
