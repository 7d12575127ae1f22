"""The engine's live requests: groups by request id, sequences by sequence id; and the one
place a request becomes a sequence group (`make_sequence_group`)."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable

from pagedllm.core.sequence import Sequence, SequenceGroup
from pagedllm.outputs import RequestMetrics
from pagedllm.sampling_params import SamplingParams, SamplingType


class RequestRegistry:
    """Every request from `add_request` until its final output, and every sequence of it that
    is still live (forks join, dropped beams leave). Sequence ids are never reused."""

    def __init__(self) -> None:
        self.groups: dict[str, SequenceGroup] = {}
        self.seqs: dict[int, Sequence] = {}
        self._seq_ids = itertools.count()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def __len__(self) -> int:
        return len(self.groups)

    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    def add_group(self, group: SequenceGroup) -> None:
        self.groups[group.request_id] = group
        for seq in group.seqs:
            self.add_seq(seq)

    def add_seq(self, seq: Sequence) -> None:
        self.seqs[seq.seq_id] = seq

    def remove_seq(self, seq: Sequence) -> None:
        self.seqs.pop(seq.seq_id, None)

    def remove_group(self, group: SequenceGroup) -> None:
        self.groups.pop(group.request_id, None)
        for seq in group.seqs:
            self.remove_seq(seq)


def make_sequence_group(
    request_id: str,
    token_ids: list[int],
    params: SamplingParams,
    seq_ids: RequestRegistry,
    arrival_time: float,
    eos_token_ids: Iterable[int] = (),
    share_blocks: bool = True,
    prompt: str | None = None,
) -> SequenceGroup:
    """A request's sequence group, as every driver of the engine core builds it: a copy of
    `params` whose stop ids include `eos_token_ids` unless `ignore_eos`, and one sequence;
    parallel samples fork from it once the prompt is computed, sharing its blocks. Without
    block sharing (a measuring mode), each sample is its own sequence from the start."""
    params = copy.copy(params)
    params.all_stop_token_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        params.all_stop_token_ids |= set(eos_token_ids)
    num_seqs = params.best_of if params.sampling_type is SamplingType.RANDOM and not share_blocks else 1
    seqs = [Sequence(seq_ids.new_seq_id(), list(token_ids), sample_index=i) for i in range(num_seqs)]
    return SequenceGroup(
        request_id=request_id,
        seqs=seqs,
        sampling_params=params,
        arrival_time=arrival_time,
        prompt=prompt,
        metrics=RequestMetrics(arrival_time=arrival_time),
        forked=num_seqs > 1,
    )
