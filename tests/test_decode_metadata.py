"""A step of decodes only builds its inputs by a shorter way (worker/decode_inputs.py's
decode_metadata, attention/cpu.py's _decode_plan): the very tensors the general way builds."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pagedllm.attention import cpu as cpu_attention
from pagedllm.core.scheduler_output import ScheduledSequence
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker import model_runner

BLOCK = 16


def _decodes(seed: int, num_seqs: int, num_groups: int) -> list[ScheduledSequence]:
    rng = random.Random(seed)
    items = []
    for i in range(num_seqs):
        position = rng.choice([0, 15, 16, 17, 31, 32, 100, 255, 256]) + rng.randrange(3) * BLOCK
        blocks = position // BLOCK + 1
        tables = [rng.sample(range(1, 500), blocks) for _ in range(num_groups)]
        for g in range(1, num_groups):  # a sliding-window group: its leading blocks freed
            freed = rng.randrange(blocks)
            tables[g][:freed] = [None] * freed
        items.append(ScheduledSequence(seq_id=i, request_id=f"r{i}", token_ids=[rng.randrange(50000)],
                                       start_position=position, block_table=tables[0],
                                       sampling_params=SamplingParams(temperature=0), other_block_tables=tables[1:]))
    return items


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    else:
        assert a == b


@pytest.mark.parametrize("seed, num_seqs, num_groups", [(0, 1, 1), (1, 3, 1), (2, 1, 6), (3, 5, 3), (4, 8, 2)])
def test_the_decode_way_builds_the_general_ways_tensors(seed, num_seqs, num_groups):
    items = _decodes(seed, num_seqs, num_groups)
    cpu = torch.device("cpu")
    fast_ids, fast_positions, fast = model_runner.build_attention_metadata(items, BLOCK, cpu)
    ids, positions, general = model_runner._batch_metadata(items, BLOCK, cpu)
    _same(fast_ids, ids)
    _same(fast_positions, positions)
    assert len(fast.other_groups) == len(general.other_groups) == num_groups - 1
    for group in range(num_groups):
        a, b = fast.for_group(group), general.for_group(group)
        for field in dataclasses.fields(a):
            if field.name not in ("other_groups", "backend_plan"):
                _same(getattr(a, field.name), getattr(b, field.name))
        # the attention plan of a decode step, the short way and the general way (num_decodes unset)
        for window, capped in [(None, False), (64, True)]:
            fast_plan = cpu_attention._plan(a, False, window, capped)
            general_plan = cpu_attention._plan(dataclasses.replace(b, num_decodes=0), False, window, capped)
            for field in dataclasses.fields(fast_plan):
                _same(getattr(fast_plan, field.name), getattr(general_plan, field.name))


def test_a_step_with_a_prompt_takes_the_general_way(monkeypatch):
    items = _decodes(5, 2, 1)
    items.append(dataclasses.replace(items[0], seq_id=9, token_ids=[1, 2, 3], start_position=0, block_table=[7]))
    monkeypatch.setattr(model_runner, "decode_metadata", lambda *a: pytest.fail("a prompt is not a decode"))
    _, positions, metadata = model_runner.build_attention_metadata(items, BLOCK, torch.device("cpu"))
    assert positions.tolist()[-3:] == [0, 1, 2] and metadata.query_lens == [1, 1, 3] and metadata.num_decodes == 2
