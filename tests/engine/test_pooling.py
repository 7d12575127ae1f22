"""Pooling requests through the engine's own core (scheduler, block manager, output processing)
and the model runner's pooling, over a fake model whose hidden state at a position is
[token id, position]: a prompt's pooled vector is then known exactly, however it was chunked,
preempted and recomputed."""

from __future__ import annotations

import itertools

import pytest
import torch

from pagedllm.core.model_output import ModelRunnerOutput, SequenceStepOutput
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.engine.pooling import PoolState, finish_pool
from pagedllm.engine.requests import make_sequence_group
from pagedllm.pooling_params import PoolingParams, PoolingType
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import ModelRunner
from tests.engine.fakes import FakeEngine, tokens

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def fake_model(seen: list[SchedulerOutput]):
    """Each step: hidden rows [token, position] for every scheduled token, pooled by the real
    runner's code; sampling sequences draw token 1."""

    def respond(out: SchedulerOutput) -> ModelRunnerOutput:
        seen.append(out)
        rows = [[float(t), float(item.start_position + j)] for item in out.seqs for j, t in enumerate(item.token_ids)]
        hidden = torch.tensor(rows)
        starts = [0, *itertools.accumulate(len(item.token_ids) for item in out.seqs)]
        result = ModelRunnerOutput({item.seq_id: SequenceStepOutput(samples=tokens(1)) for item in out.seqs
                                    if item.num_samples})
        pooling = [(i, item) for i, item in enumerate(out.seqs) if item.pooling_type is not None]
        ModelRunner._pool(hidden, starts, pooling, result)
        return result

    return respond


def expected(prompt: list[int], pooling_type: PoolingType) -> list[float]:
    rows = torch.tensor([[float(t), float(p)] for p, t in enumerate(prompt)])
    return {PoolingType.MEAN: rows.mean(0), PoolingType.LAST: rows[-1], PoolingType.CLS: rows[0]}[pooling_type].tolist()


def add_pooling(engine: FakeEngine, request_id: str, prompt: list[int], params: PoolingParams):
    group = make_sequence_group(request_id, prompt, SamplingParams(temperature=0, max_tokens=1), engine.requests,
                                float(next(engine._clock)))
    group.pooling_params = params
    engine.core.add(group)
    return group


@pytest.mark.parametrize("pooling_type", list(PoolingType))
def test_a_chunked_prompt_preempted_and_recomputed_pools_to_its_exact_vector(pooling_type):
    """8 blocks of 4 slots cannot hold a decode beside a 24-token prompt computed 3 tokens a
    step: the prompt (the newer) is preempted by recomputation mid-way and computed again from
    its start."""
    engine = FakeEngine(block_size=4, num_blocks=8, max_num_seqs=2, max_num_batched_tokens=4)
    generation = engine.add("gen", [3, 4, 5, 6], GREEDY)
    prompt = list(range(10, 34))
    group = add_pooling(engine, "pool", prompt, PoolingParams(pooling_type=pooling_type, normalize=False))
    seen: list[SchedulerOutput] = []
    for _ in range(100):
        if group.is_finished and generation.is_finished:
            break
        engine.run_step(fake_model(seen))
    assert group.is_finished and generation.is_finished
    assert engine.scheduler.stats.num_recompute_preemptions >= 1
    assert group.pooled.result.tolist() == pytest.approx(expected(prompt, pooling_type))
    pooled_items = [item for out in seen for item in out.seqs if item.seq_id == group.seqs[0].seq_id]
    assert len(pooled_items) > 3 and all(item.num_samples == 0 for item in pooled_items)
    assert generation.seqs[0].output_token_ids == [1] * 16
    assert engine.bm.num_free_blocks == engine.bm.num_total_blocks


def test_a_pooling_request_ends_and_frees_its_blocks_in_the_step_its_prompt_completes():
    engine = FakeEngine(block_size=4, num_blocks=16, max_num_batched_tokens=8)
    group = add_pooling(engine, "pool", list(range(10, 30)), PoolingParams(pooling_type="mean"))
    seen: list[SchedulerOutput] = []
    for step in range(3):  # 8 + 8 + 4 tokens
        engine.run_step(fake_model(seen))
        assert group.is_finished == (step == 2)
        assert engine.bm.num_free_blocks < engine.bm.num_total_blocks or step == 2
    assert engine.bm.num_free_blocks == engine.bm.num_total_blocks
    assert "pool" not in engine.requests
    assert [item.start_position for out in seen for item in out.seqs] == [0, 8, 16]


def test_finishing_cuts_to_dimensions_then_normalizes():
    state = PoolState(torch.tensor([3.0, 4.0, 12.0]))
    assert finish_pool(state, PoolingParams(pooling_type="last", normalize=True, dimensions=2), 1).tolist() == \
        pytest.approx([0.6, 0.8])
    state = PoolState(torch.tensor([3.0, 4.0, 12.0]))
    assert finish_pool(state, PoolingParams(pooling_type="mean", normalize=False, dimensions=2), 2).tolist() == \
        pytest.approx([1.5, 2.0])


@pytest.mark.parametrize("value", ["all", "step", "rank", "max", 3])
def test_pooling_types_not_built_are_refused_by_name(value):
    with pytest.raises(ValueError, match="pooling_type"):
        PoolingParams(pooling_type=value)
