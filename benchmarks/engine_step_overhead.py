"""The engine's own per-step cost without a model: the step loop (scheduling, block tables,
output processing with a stand-in tokenizer) over a fake executor, per step, for a number of
concurrent greedy streams. It runs against any checkout (`PYTHONPATH=<checkout>`), through
`tests/engine/fakes.py`'s `FakeEngine.step(sample)`, whose signature both the old step loop and
`EngineCore` keep, so two commits compare in one run:

    for tree in /path/base /path/new; do PYTHONPATH=$tree python benchmarks/engine_step_overhead.py; done

Prints a table and writes JSON (--output-json)."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time


def measure(streams: int, steps: int, repeats: int) -> dict:
    from pagedllm.sampling_params import SamplingParams
    from tests.engine.fakes import FakeEngine, tokens

    per_step = []
    for _ in range(repeats):
        engine = FakeEngine(block_size=16, num_blocks=streams * 32, max_model_len=4096, max_num_seqs=streams,
                            max_num_batched_tokens=max(2048, streams * 64))
        params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
        for i in range(streams):
            engine.add(f"r{i}", [1 + (i + j) % 7 for j in range(32)], params)
        engine.step(lambda item: tokens(1))  # the prompts
        start = time.perf_counter()
        for _ in range(steps):
            engine.step(lambda item: tokens(1 + item.seq_id % 7))
        per_step.append((time.perf_counter() - start) / steps)
    return {"streams": streams, "steps": steps, "us_per_step_min": min(per_step) * 1e6,
            "us_per_step_median": statistics.median(per_step) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    rows = [measure(n, args.steps, args.repeats) for n in args.streams]
    import pagedllm

    print(f"checkout: {pagedllm.__file__.rsplit('/pagedllm/', 1)[0]}; cpu: {platform.processor() or platform.machine()}")
    print(f"{'streams':>7}  {'us/step (min)':>13}  {'us/step (median)':>16}")
    for row in rows:
        print(f"{row['streams']:>7}  {row['us_per_step_min']:>13.1f}  {row['us_per_step_median']:>16.1f}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"benchmark": "engine_step_overhead", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
