"""The request lifecycle: sequences, the KV cache manager and the scheduler.

Pure Python: nothing here imports torch, numpy or any other heavy library, so these parts are
tested in milliseconds and drive the workers only through plain-data `SchedulerOutput`s.
"""

from pagedllm.core.block_manager import BlockManager, PendingCacheOps
from pagedllm.core.block_pool import BlockPool, KVBlock
from pagedllm.core.kv_breakdown import KVBreakdown
from pagedllm.core.policies import create_scheduler
from pagedllm.core.reservation import KVPolicy, ReservationBlockManager
from pagedllm.core.reservation_scheduler import ReservationScheduler
from pagedllm.core.preemption import PreemptionMode
from pagedllm.core.scheduler import Scheduler, SchedulerStats
from pagedllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedllm.core.sequence import BeamState, Detokenizer, Sequence, SequenceGroup, SequenceStatus

__all__ = [
    "BeamState",
    "BlockManager",
    "BlockPool",
    "Detokenizer",
    "KVBlock",
    "KVBreakdown",
    "KVPolicy",
    "PendingCacheOps",
    "PreemptionMode",
    "ReservationBlockManager",
    "ReservationScheduler",
    "ScheduledSequence",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "Sequence",
    "SequenceGroup",
    "SequenceStatus",
    "create_scheduler",
]
