"""The scheduler and KV cache manager of each memory policy (`SchedulerConfig.kv_policy`):
blocks on demand for `paged` (the engine itself), contiguous reservations for the paper's
baselines."""

from __future__ import annotations

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.reservation import KVPolicy, ReservationBlockManager
from pagedllm.core.reservation_scheduler import ReservationScheduler
from pagedllm.core.scheduler import Scheduler


def create_scheduler(
    config: SchedulerConfig,
    block_size: int,
    num_device_blocks: int,
    num_cpu_blocks: int,
    max_model_len: int,
    enable_prefix_caching: bool = True,
    group_windows: tuple[int | None, ...] = (None,),
    share_blocks: bool = True,
) -> Scheduler:
    """A scheduler with its block manager (`scheduler.block_manager`) for `config.kv_policy`;
    `group_windows` holds the sliding window of each KV cache group (None: full attention);
    without `share_blocks` (a measuring mode), forks copy their parent's blocks."""
    policy = KVPolicy(config.kv_policy)
    if policy is KVPolicy.PAGED:
        block_manager = BlockManager(
            block_size, num_device_blocks, num_cpu_blocks, enable_prefix_caching=enable_prefix_caching,
            watermark=config.watermark, group_windows=group_windows,
        )
        return Scheduler(config, block_manager, share_blocks)
    return ReservationScheduler(
        config, ReservationBlockManager(policy, block_size, num_device_blocks, max_model_len, len(group_windows)), share_blocks
    )
