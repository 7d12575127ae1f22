"""The bookkeeping invariants of one block pool against the block tables that hold its blocks
(`BlockManager.check_invariants` runs them for the device pool and the CPU swap pool)."""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool, KVBlock


def check_pool(name: str, pool: BlockPool, tables: list[list[KVBlock | None]]) -> None:
    """Raise `AssertionError` naming the first broken invariant: each block's reference count
    equals the table entries holding it, the free queue holds exactly the unreferenced blocks,
    and every block in the prefix-cache index carries the key it is indexed under."""
    holders = [0] * pool.num_blocks
    for blocks in tables:
        for block in blocks:
            if block is None:
                continue
            if pool.blocks[block.block_id] is not block:
                raise AssertionError(f"a {name} table holds block {block.block_id} of another pool")
            holders[block.block_id] += 1
    for block in pool.blocks:
        if block.ref_count != holders[block.block_id]:
            raise AssertionError(
                f"{name} block {block.block_id} has reference count {block.ref_count} "
                f"but {holders[block.block_id]} block tables hold it"
            )
    queued = [block.block_id for block in pool.free_queue]
    unreferenced = sorted(block.block_id for block in pool.blocks if block.ref_count == 0)
    if len(queued) != pool.num_free_blocks or sorted(queued) != unreferenced:
        raise AssertionError(
            f"the {name} free queue holds {len(queued)} blocks but {len(unreferenced)} are unreferenced "
            f"(free + referenced must equal the {pool.num_blocks} blocks)"
        )
    for block_hash, block in pool.cached.items():
        if block.block_hash != block_hash:
            raise AssertionError(f"{name} block {block.block_id} is indexed under a hash it does not carry")
