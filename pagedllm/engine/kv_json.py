"""The KV snapshot (`core.kv_snapshot`) as JSON: what `GET /debug/kv` answers and the
dashboard's events carry (README, "Live KV-cache dashboard", documents the fields)."""

from __future__ import annotations

from pagedllm.core.kv_snapshot import DEFAULT_MAX_CELLS, KVSnapshot, PoolView, aggregate_cells

__all__ = ["DEFAULT_MAX_CELLS", "snapshot_json"]


def _pool_json(pool: PoolView, max_cells: int, copied: list[int], with_blocks: bool) -> dict:
    cells = aggregate_cells(pool, max_cells, copied)
    body = {
        "num_blocks": pool.num_blocks,
        "num_free_blocks": pool.num_free_blocks,
        "blocks_per_cell": cells[0].num_blocks if cells else 1,
        # Cells with nothing held or cached are left out: they are free.
        "cells": [
            {
                "first_block": c.first_block,
                "num_blocks": c.num_blocks,
                "num_held": c.num_held,
                "num_cached": c.num_cached,
                "num_shared": c.num_shared,
                "max_ref_count": c.max_ref_count,
                "num_tokens": c.num_tokens,
                "owner": c.owner,
                "copied_on_write": c.copied_on_write,
            }
            for c in cells
            if c.num_held or c.num_cached or c.copied_on_write
        ],
    }
    if with_blocks:
        body["blocks"] = [
            {"id": b.block_id, "ref_count": b.ref_count, "num_tokens": b.num_tokens, "cached": b.cached, "owners": b.owners}
            for b in pool.blocks().values()
        ]
    return body


def snapshot_json(snapshot: KVSnapshot, max_cells: int = DEFAULT_MAX_CELLS, with_blocks: bool = True) -> dict:
    """The snapshot in the documented JSON form (README, "Live KV-cache dashboard")."""
    copied = [dst for _, dst in snapshot.copy_on_writes]
    return {
        "block_size": snapshot.block_size,
        "device": _pool_json(snapshot.device, max_cells, copied, with_blocks),
        "cpu": _pool_json(snapshot.cpu, max_cells, [], with_blocks),
        "copy_on_writes": [list(move) for move in snapshot.copy_on_writes],
        "num_copy_on_writes": snapshot.num_copy_on_writes,
        "requests": [
            {
                "id": r.request_id,
                "status": r.status,
                "shares_with": r.shares_with,
                "seqs": [
                    {"seq_id": s.seq_id, "status": s.status, "pool": s.pool, "block_ids": s.block_ids, "num_tokens": s.num_tokens,
                     "other_block_ids": s.other_block_ids}
                    for s in r.seqs
                ],
            }
            for r in snapshot.requests
        ],
    }
