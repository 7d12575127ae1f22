"""The engine's live requests: groups by request id, sequences by sequence id."""

from __future__ import annotations

import itertools

from pagedllm.core.sequence import Sequence, SequenceGroup


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
