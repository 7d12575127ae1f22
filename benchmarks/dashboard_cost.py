"""What the live dashboard costs the engine: step time with the page closed and open, and the
share of step time spent building KV snapshots; then a 100,000-block pool's snapshot and JSON.

    .venv/bin/python benchmarks/dashboard_cost.py                 # the default model
    .venv/bin/python benchmarks/dashboard_cost.py --model PATH    # any other model folder

The engine is stepped here as the async engine's loop steps it, with the dashboard's
`KVMonitor` recording after every step; "open" asks for snapshots all along, as an open page does.
Prints a table and writes results/dashboard_cost.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pagedllm.config import EngineArgs
from pagedllm.core import BlockManager, Sequence, SequenceGroup, SequenceStatus
from pagedllm.core.kv_snapshot import build_kv_snapshot
from pagedllm.engine.iteration_stats import IterationStats
from pagedllm.engine.kv_monitor import KVMonitor
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.kv_json import snapshot_json
from pagedllm.sampling_params import SamplingParams


def run(engine: LLMEngine, page_open: bool, num_requests: int, max_tokens: int) -> dict:
    monitor = KVMonitor(engine)
    before = engine.get_stats()
    for i in range(num_requests):
        params = SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(f"{'open' if page_open else 'closed'}-{i}", list(range(100 + i, 160 + i)), params)
    steps = 0
    while engine.has_unfinished_requests():
        if page_open:
            monitor.want()
        engine.step()
        steps += 1
        monitor.record(engine.get_stats(), IterationStats(now=time.monotonic()))
    after = engine.get_stats()
    step_s = sum(vars(after.step_time).values()) - sum(vars(before.step_time).values())
    return {
        "page": "open" if page_open else "closed",
        "steps": steps,
        "mean_step_ms": 1e3 * step_s / steps,
        "snapshots": monitor.cost.num_snapshots,
        "mean_snapshot_ms": 1e3 * monitor.cost.snapshot_seconds / max(1, monitor.cost.num_snapshots),
        "share_of_step_time": monitor.cost.share_of_step_time,
    }


def large_pool(num_blocks: int = 100_000, block_size: int = 16) -> dict:
    """A pool of `num_blocks`, 80% held by 400 pairs of sequences that share their prompts."""
    bm = BlockManager(block_size, num_blocks, 0, enable_prefix_caching=True, watermark=0.0)
    groups = []
    blocks_per_seq = num_blocks * 8 // 10 // 800
    for i in range(400):
        parent = Sequence(2 * i, [i] * (block_size * blocks_per_seq // 2))
        bm.allocate(parent, parent.num_tokens)
        parent.num_computed_tokens = parent.num_tokens
        bm.commit(parent)
        child = parent.fork(2 * i + 1)
        bm.fork(parent, child)
        for seq in (parent, child):  # each writes as many tokens again, on blocks of its own
            grown = block_size * blocks_per_seq // 2
            for _ in range(grown):
                seq.append_token(1, 0.0)
            bm.allocate(seq, grown)
            seq.num_computed_tokens += grown
        group = SequenceGroup(f"r{i}", [parent, child], SamplingParams(), 0.0)
        group.set_status(SequenceStatus.RUNNING)
        groups.append(group)
    start = time.perf_counter()
    snapshot = build_kv_snapshot(bm, groups)
    built = time.perf_counter()
    event = json.dumps(snapshot_json(snapshot, with_blocks=False))
    encoded = time.perf_counter()
    full = json.dumps(snapshot_json(snapshot, with_blocks=True))
    return {
        "num_blocks": num_blocks,
        "held": num_blocks - bm.num_free_blocks,
        "build_ms": 1e3 * (built - start),
        "event_json_ms": 1e3 * (encoded - built),
        "event_kib": len(event) / 1024,
        "debug_kv_kib": len(full) / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the embedded default model)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    engine = LLMEngine.from_engine_args(EngineArgs(model=args.model, kv_cache_memory=256 << 20, max_model_len=1024))
    run(engine, False, 2, 8)  # warm-up
    rows = [run(engine, page_open, args.requests, args.max_tokens) for page_open in (False, True, False, True)]
    print(f"{'page':<7}{'steps':>6}{'step ms':>10}{'snapshots':>11}{'snapshot ms':>13}{'share of step':>15}")
    for r in rows:
        share = "-" if r["share_of_step_time"] is None else f"{100 * r['share_of_step_time']:.3f}%"
        print(f"{r['page']:<7}{r['steps']:>6}{r['mean_step_ms']:>10.2f}{r['snapshots']:>11}{r['mean_snapshot_ms']:>13.3f}{share:>15}")
    pool = large_pool()
    print(
        f"100,000-block pool ({pool['held']} held): snapshot {pool['build_ms']:.0f} ms, event JSON {pool['event_json_ms']:.0f} ms "
        f"({pool['event_kib']:.0f} KiB), /debug/kv {pool['debug_kv_kib']:.0f} KiB"
    )
    out = Path(__file__).resolve().parents[1] / "results" / "dashboard_cost.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"model": engine.model_name, "runs": rows, "large_pool": pool}, indent=2))
    engine.shutdown()


if __name__ == "__main__":
    main()
