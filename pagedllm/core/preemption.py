"""How a preempted group gives its blocks back: swapped to CPU memory or dropped and recomputed."""

from __future__ import annotations

import enum

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.sequence import SequenceGroup


class PreemptionMode(enum.Enum):
    """How a preempted group gives its blocks back (the configuration's `auto` picks one per victim)."""

    SWAP = "swap"  # copy its blocks to the CPU pool, and back when it resumes
    RECOMPUTE = "recompute"  # drop its blocks; it resumes as one prefill of all its tokens


def choose_preemption_mode(config: SchedulerConfig, block_manager: BlockManager, group: SequenceGroup) -> PreemptionMode:
    """How to evict this victim.

    A group still computing its prompt is always recomputed: its blocks are incomplete and
    resuming it is a prefill either way. Otherwise `auto` swaps a group of several sequences
    (parallel samples, beams), because recomputing it would redo the shared prompt once per
    sequence and lose the sharing; a single sequence swaps when moving its blocks is
    estimated to cost less than recomputing its tokens.
    """
    seqs = group.unfinished_seqs()
    if any(seq.num_uncomputed_tokens > 1 for seq in seqs) or block_manager.num_cpu_blocks == 0:
        return PreemptionMode.RECOMPUTE
    if config.preemption_mode != "auto":
        return PreemptionMode(config.preemption_mode)
    if len(seqs) > 1:
        return PreemptionMode.SWAP
    tokens = sum(seq.num_computed_tokens for seq in seqs)
    blocks = sum(block_manager.num_blocks_held(seq.seq_id) for seq in seqs)
    swap_cost = blocks * config.swap_cost_per_block
    return PreemptionMode.SWAP if swap_cost < tokens * config.recompute_cost_per_token else PreemptionMode.RECOMPUTE
