"""Contiguous reservations per sequence: the KV memory of the paper's baselines.

Orca and FasterTransformer store each sequence's KV cache in one contiguous region, reserved
when the request is admitted for as many tokens as it may ever hold. The paper re-implemented
Orca with three reservation sizes; its artifact rounds each reservation, in blocks, up to a
power of two (a buddy allocator, `core.buddy`). The policies:

- `orca-oracle`: prompt + the true output length (known here because benchmarks force it with
  `max_tokens` and `ignore_eos`);
- `orca-pow2`: prompt + the next power of two at or above the output length (at most 2x over);
- `orca-max`: the maximum sequence length (`max_model_len`);
- `static` (FasterTransformer-style static batching): the maximum length too; the scheduler
  (`core.reservation_scheduler`) admits whole batches.

Every sequence of a request (parallel samples, beams) has a reservation of its own, all taken
at admission: the request's first sequence holds one and the rest wait as spares until forks
take them. A fork copies the parent's blocks (nothing is shared). When a sequence ends its
reservation returns to its request's spares; when the request's last sequence ends, all its
reservations return to the allocator. Nothing is ever preempted: a request is admitted only if
all of its reservations fit.

The block table of a sequence is the leading part of its run, `start, start + 1, ...`, so the
workers run the same paged kernels over it. A model whose layers form several KV cache groups
(full and sliding-window layers) reserves as for full attention in each: a run holds one
equal span per group, and group g's table is the leading part of span g. Windows free nothing
here (the run is reserved whole either way). This manager offers the subset of `BlockManager`'s
interface that the scheduler, output processor and engine use.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.core.block_manager import BlockMove, PendingCacheOps
from pagedllm.core.buddy import BuddyAllocator, order_for
from pagedllm.core.kv_breakdown import KVBreakdown
from pagedllm.core.sequence import Sequence, SequenceGroup
from pagedllm.sampling_params import SamplingType
from pagedllm.utils import cdiv


class KVPolicy(enum.Enum):
    """How the scheduler gives sequences KV memory (`SchedulerConfig.kv_policy`)."""

    PAGED = "paged"  # blocks on demand, shared copy-on-write, preemption (the engine itself)
    ORCA_ORACLE = "orca-oracle"
    ORCA_POW2 = "orca-pow2"
    ORCA_MAX = "orca-max"
    STATIC = "static"


def next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def reserved_tokens(policy: KVPolicy, prompt_len: int, output_len: int, max_model_len: int) -> int:
    """Tokens a sequence reserves at admission under `policy` (before rounding to blocks)."""
    if policy is KVPolicy.ORCA_ORACLE:
        tokens = prompt_len + output_len
    elif policy is KVPolicy.ORCA_POW2:
        tokens = prompt_len + next_power_of_two(output_len)
    elif policy in (KVPolicy.ORCA_MAX, KVPolicy.STATIC):
        tokens = max_model_len
    else:
        raise ValueError(f"{policy.value!r} does not reserve memory ahead")
    return min(tokens, max_model_len)


@dataclass(eq=False, slots=True)
class Reservation:
    start: int  # first block of the run
    num_blocks: int  # the run's length, a power of two
    final_tokens: int  # KV slots the sequence will really fill: prompt + output - 1
    num_tokens: int = 0  # KV slots filled (computed tokens)
    num_used_blocks: int = 0  # blocks its block table covers


@dataclass(eq=False)
class _RequestReservations:
    holders: set[int] = field(default_factory=set)  # sequence ids holding one of them
    spares: list[Reservation] = field(default_factory=list)  # for forks yet to come
    all: list[Reservation] = field(default_factory=list)


def num_reserved_seqs(group: SequenceGroup) -> int:
    """Sequences a request may run at once: its samples or beams (best_of), or one."""
    if group.sampling_params.sampling_type is SamplingType.GREEDY:
        return max(1, len(group.seqs))
    return max(len(group.seqs), group.sampling_params.best_of)


class ReservationBlockManager:
    def __init__(
        self, policy: KVPolicy, block_size: int, num_device_blocks: int, max_model_len: int, num_groups: int = 1
    ) -> None:
        if policy is KVPolicy.PAGED:
            raise ValueError("the paged policy uses BlockManager")
        self.policy = policy
        self.block_size = block_size
        self.num_groups = num_groups  # KV cache groups: one span of each run per group
        self.max_model_len = max_model_len
        self.buddy = BuddyAllocator(num_device_blocks)
        self._reservations: dict[int, Reservation] = {}  # seq id -> its reservation
        self._request_of: dict[int, str] = {}  # seq id -> request id
        self._requests: dict[str, _RequestReservations] = {}
        self._copies: list[BlockMove] = []
        self.num_blocks_copied = 0
        # What BlockManager reports and the reservation policies never do.
        self.watermark_blocks = 0
        self.num_copy_on_writes = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_cpu_blocks = 0
        self.num_free_cpu_blocks = 0

    # --- queries ---------------------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        return self.buddy.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.buddy.num_free_blocks

    @property
    def usable_blocks(self) -> int:
        return self.buddy.num_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(1, self.num_total_blocks)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def run_order(self, prompt_len: int, output_len: int) -> int:
        """The buddy order of one sequence's reservation."""
        tokens = reserved_tokens(self.policy, prompt_len, output_len, self.max_model_len)
        return order_for(self.num_groups * self.blocks_for_tokens(tokens))

    def max_blocks_held(
        self, prompt_len: int, num_seqs: int, max_len: int, share_prompt: bool, max_chunk: int | None = None
    ) -> int:
        """Blocks `num_seqs` sequences of a request reserve when they may grow to `max_len`."""
        return num_seqs << self.run_order(prompt_len, max_len - prompt_len)

    def max_blocks_of_sequence(self, num_tokens: int, max_chunk: int | None = None) -> int:
        return self.num_groups * self.blocks_for_tokens(num_tokens)

    def _span(self, res: Reservation) -> int:
        """Blocks of each group's part of a run."""
        return res.num_blocks // self.num_groups

    def has_blocks(self, seq_id: int) -> bool:
        return seq_id in self._reservations

    def block_ids(self, seq_id: int, group: int = 0) -> list[int]:
        res = self._reservations[seq_id]
        first = res.start + group * self._span(res)
        return list(range(first, first + res.num_used_blocks))

    def block_tables(self, seq_id: int) -> list[list[int]]:
        return [self.block_ids(seq_id, group) for group in range(self.num_groups)]

    def num_blocks_held(self, seq_id: int) -> int:
        return self.num_groups * self._reservations[seq_id].num_used_blocks

    def live_tables(self) -> dict[int, list[int]]:
        return {seq_id: [b for table in self.block_tables(seq_id) for b in table] for seq_id in self._reservations}

    # --- admission -------------------------------------------------------------------------

    def _orders(self, group: SequenceGroup) -> list[int]:
        seq = group.seqs[0]
        max_tokens = group.sampling_params.max_tokens
        output_len = max_tokens if max_tokens is not None else self.max_model_len - seq.num_prompt_tokens
        return [self.run_order(seq.num_prompt_tokens, output_len)] * num_reserved_seqs(group)

    def can_reserve(self, group: SequenceGroup) -> bool:
        return self.buddy.can_allocate(self._orders(group))

    def can_ever_reserve(self, group: SequenceGroup) -> bool:
        return self.buddy.can_ever_allocate(self._orders(group))

    def reserve(self, group: SequenceGroup) -> None:
        """Reserve a run for every sequence the request may have (check `can_reserve` first)."""
        if group.request_id in self._requests:
            raise RuntimeError(f"request {group.request_id} already holds reservations")
        params = group.sampling_params
        prompt_len = group.seqs[0].num_prompt_tokens
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - prompt_len
        final_tokens = min(prompt_len + max_tokens, self.max_model_len) - 1
        request = self._requests[group.request_id] = _RequestReservations()
        for order in self._orders(group):
            request.all.append(Reservation(self.buddy.allocate(order), 1 << order, final_tokens))
        request.spares = list(reversed(request.all))
        for seq in group.unfinished_seqs():
            self._hold(group.request_id, seq.seq_id, request.spares.pop())

    def _hold(self, request_id: str, seq_id: int, res: Reservation) -> None:
        self._reservations[seq_id] = res
        self._request_of[seq_id] = request_id
        self._requests[request_id].holders.add(seq_id)

    # --- per step --------------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend the sequence's block table, inside its reservation, by `num_new_tokens`."""
        res = self._reservations[seq.seq_id]
        needed = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        if needed > self._span(res):
            raise RuntimeError(
                f"sequence {seq.seq_id} outgrew its reservation of {self._span(res)} blocks "
                f"({seq.num_computed_tokens + num_new_tokens} tokens); its request's max_tokens was exceeded"
            )
        res.num_used_blocks = max(res.num_used_blocks, needed)

    def commit(self, seq: Sequence) -> None:
        self._reservations[seq.seq_id].num_tokens = seq.num_computed_tokens

    def can_fork(self, parent: Sequence, share: bool = True) -> bool:
        request = self._requests.get(self._request_of.get(parent.seq_id, ""))
        return request is not None and bool(request.spares)

    def fork(self, parent: Sequence, child: Sequence, share: bool = True) -> None:
        """`child` takes one of the request's spare reservations and a copy of the parent's
        blocks (contiguous memory cannot be shared, whatever `share` says)."""
        request_id = self._request_of[parent.seq_id]
        source = self._reservations[parent.seq_id]
        res = self._requests[request_id].spares.pop()
        res.num_tokens, res.num_used_blocks = source.num_tokens, source.num_used_blocks
        for group in range(self.num_groups):
            src, dst = source.start + group * self._span(source), res.start + group * self._span(res)
            self._copies.extend((src + i, dst + i) for i in range(source.num_used_blocks))
        self.num_blocks_copied += self.num_groups * source.num_used_blocks
        self._hold(request_id, child.seq_id, res)

    def free(self, seq: Sequence, keep_hashes: bool = False) -> None:
        """The sequence ended: its reservation returns to its request's spares, and all of the
        request's reservations to the allocator once none of its sequences is left."""
        res = self._reservations.pop(seq.seq_id, None)
        if res is None:
            return
        request_id = self._request_of.pop(seq.seq_id)
        request = self._requests[request_id]
        request.holders.discard(seq.seq_id)
        res.num_tokens = res.num_used_blocks = 0
        request.spares.append(res)
        if not request.holders:
            for reservation in request.all:
                self.buddy.free(reservation.start)
            del self._requests[request_id]

    def drain_pending(self) -> PendingCacheOps:
        copies, self._copies = self._copies, []
        return PendingCacheOps([], [], copies)

    def find_cached_prefix(self, seq: Sequence) -> list:
        return []  # contiguous reservations share nothing, prefixes included

    def reset_prefix_cache(self) -> int:
        return 0

    # --- accounting ------------------------------------------------------------------------

    def slot_breakdown(self, seqs: Iterable[Sequence] = ()) -> KVBreakdown:
        """What the device's slots hold (`core.kv_breakdown`). A held run's slots hold token
        states up to the sequence's computed tokens, are reserved up to its true final length,
        and are internal fragmentation beyond; a spare run is reserved up to that length too.
        O(reservations); `seqs` is not needed (commit records the fill)."""
        bs = self.block_size
        parts = KVBreakdown()
        for request in self._requests.values():
            for res in request.all:
                groups = self.num_groups
                final = min(res.final_tokens, self._span(res) * bs)  # in each group's span
                filled = min(res.num_tokens, final)
                parts.token_states += groups * filled
                parts.reservation += groups * (final - filled)
                parts.internal_fragmentation += res.num_blocks * bs - groups * final
        parts.external_fragmentation_free = self.buddy.num_blocks * bs - (
            parts.token_states + parts.reservation + parts.internal_fragmentation
        )
        return parts

    def check_invariants(self) -> None:
        """Raise `AssertionError` if a reservation is not an allocated run, a table outgrows its
        run, or the requests' bookkeeping disagrees with the sequences'."""
        self.buddy.check_invariants()
        allocated = self.buddy.allocated_runs()
        for request_id, request in self._requests.items():
            if not request.holders:
                raise AssertionError(f"request {request_id} holds reservations but no sequence")
            if len(request.spares) + len(request.holders) != len(request.all):
                raise AssertionError(f"request {request_id}: spares and held reservations do not add up")
            for res in request.all:
                order = allocated.pop(res.start, None)
                if order is None or res.num_blocks != 1 << order:
                    raise AssertionError(f"request {request_id} holds a run at {res.start} the allocator does not")
                if res.num_used_blocks > self._span(res):
                    raise AssertionError(f"the table at {res.start} covers more blocks than its run")
        if allocated:
            raise AssertionError(f"runs at {sorted(allocated)} are allocated but no request holds them")
        for seq_id, res in self._reservations.items():
            if seq_id not in self._requests[self._request_of[seq_id]].holders:
                raise AssertionError(f"sequence {seq_id} holds a reservation its request does not know of")
