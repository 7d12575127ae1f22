"""Fairness between API requests, for the scheduler. A server request of several prompts (or
`n` samples of several prompts) becomes one engine request per prompt, all queued at once;
first come, first served would then put every one of them before a request arriving a moment
later, and let them take every seat of `max_num_seqs` for as long as they decode. Two rules
keep such a request from holding the others hostage:

- turns: the k-th waiting prompt of an API request has turn k, and the waiting queue is kept in
  order of turns (first come, first served among equal turns). A request of one prompt has turn
  0, so it waits behind the many-prompt request's first prompt, not all of them. A group
  preempted by recomputation has turn -1: it was admitted before every waiting group.
- a share of the seats: an API request's prompts together hold at most `seat_share` of the
  `max_num_seqs` seats (all but an eighth), so a request arriving while it decodes finds a seat.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable

from pagedllm.core.sequence import SequenceGroup

PREEMPTED_TURN = -1


def queue_in_turn(waiting: deque[SequenceGroup], group: SequenceGroup) -> None:
    """Put a new group in the waiting queue behind every group whose turn is not later than its own."""
    key = group.api_request_id
    group.turn = 0 if key is None else sum(1 for g in waiting if g.api_request_id == key)
    waiting.insert(bisect.bisect_right(waiting, group.turn, key=lambda g: g.turn), group)


def seat_share(max_num_seqs: int) -> int:
    """The most seats one API request of several prompts may hold: all but an eighth."""
    return max(1, max_num_seqs - max_num_seqs // 8)


def over_share(group: SequenceGroup, running: Iterable[SequenceGroup], seats: Callable[[SequenceGroup], int],
               max_num_seqs: int) -> bool:
    """Whether admitting `group` would take its API request past its share of the seats (a
    request holding none may always start one prompt)."""
    key = group.api_request_id
    if key is None:
        return False
    held = sum(seats(g) for g in running if g.api_request_id == key)
    return held > 0 and held + seats(group) > seat_share(max_num_seqs)
