"""AsyncLLMEngine: the step loop on its own thread, per-request streams, aborts, and death."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.engine.iteration_stats import IterationStats
from pagedllm.engine.stat_logger import LoggingStatLogger
from tests.helpers import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE_KWARGS = dict(max_model_len=256, num_gpu_blocks=128)


class RecordingLogger:
    def __init__(self) -> None:
        self.iterations: list[IterationStats] = []

    def record(self, stats, iteration) -> None:
        self.iterations.append(iteration)


@pytest.fixture(scope="module")
def recorder():
    return RecordingLogger()


@pytest.fixture(scope="module")
def engine(tiny_llama, recorder):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), **ENGINE_KWARGS), [recorder])
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, [3, 9, 17, 30], seed=5)


@pytest.fixture(scope="module")
def expected(tiny_llama, prompts):
    llm = LLM(str(tiny_llama), **ENGINE_KWARGS)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


async def collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_concurrent_requests_stream_cumulative_outputs_matching_the_offline_engine(engine, prompts, expected):
    async def main():
        return await asyncio.gather(*(collect(engine, p, GREEDY, f"cum-{i}") for i, p in enumerate(prompts)))

    streams = asyncio.run(main())
    for outputs, want in zip(streams, expected):
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        tokens = [o.outputs[0].token_ids for o in outputs]
        assert all(a == b[: len(a)] and len(a) < len(b) for a, b in zip(tokens, tokens[1:]))  # cumulative
        assert tokens[-1] == want


def test_bad_request_raises_and_the_engine_keeps_serving(engine, prompts, expected):
    async def main():
        with pytest.raises(ValueError, match="prompt is empty"):
            await engine.add_request("bad-empty", [], GREEDY)
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request("bad-long", [5] * 300, GREEDY)
        return await collect(engine, prompts[0], GREEDY, "after-bad")

    assert asyncio.run(main())[-1].outputs[0].token_ids == expected[0]
    assert engine.is_healthy


def test_closing_the_generator_early_aborts_and_frees_blocks(engine, recorder):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        generators = [engine.generate([7, 8, 9] * (i + 1), long, f"early-{i}") for i in range(4)]
        for gen in generators:
            await gen.__anext__()  # running, blocks allocated
        for gen in generators:
            await gen.aclose()

    asyncio.run(main())
    wait_until(lambda: engine.stats.num_running == 0 and engine.stats.num_free_blocks == engine.stats.num_total_blocks)
    aborted = [f for it in recorder.iterations for f in it.finished if f.finish_reason == "abort"]
    assert len(aborted) == 4
    assert not engine.engine.has_unfinished_requests()


def test_stat_loggers_get_first_token_and_inter_token_latencies(engine, recorder, prompts):
    before = len(recorder.iterations)
    asyncio.run(collect(engine, prompts[1], GREEDY, "timed"))
    wait_until(lambda: any(f.finish_reason == "length" for it in recorder.iterations[before:] for f in it.finished))
    new = recorder.iterations[before:]
    assert len([t for it in new for t in it.time_to_first_tokens]) == 1
    assert len([t for it in new for t in it.inter_token_latencies]) == GREEDY.max_tokens - 1
    (finished,) = [f for it in new for f in it.finished]
    assert (finished.num_prompt_tokens, finished.num_generation_tokens) == (len(prompts[1]), GREEDY.max_tokens)
    assert finished.e2e_latency > 0


@pytest.mark.parametrize("failure", ["step", "check_health"])
def test_a_failing_loop_kills_the_engine_and_fails_every_request(tiny_llama, monkeypatch, failure):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), **ENGINE_KWARGS))
    engine.IDLE_POLL_S = 0.05

    def broken(*args, **kwargs):
        raise RuntimeError("worker 1 is gone")

    async def main():
        gen = engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), "doomed")
        await gen.__anext__()
        target = engine.engine if failure == "step" else engine.engine.executor
        monkeypatch.setattr(target, failure, broken)
        with pytest.raises(EngineDeadError, match="worker 1 is gone"):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", [1, 2], GREEDY)

    asyncio.run(main())
    assert not engine.is_healthy
    engine.shutdown()


def test_a_dead_tensor_parallel_worker_fails_requests_and_the_engine(tiny_llama):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), tensor_parallel_size=2, **ENGINE_KWARGS))
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        gen = engine.generate([1, 2, 3], params, "doomed")
        await gen.__anext__()
        os.kill(engine.engine.executor._processes[0].pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="engine stopped"):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", [1, 2], params)

    try:
        asyncio.run(main())
        assert not engine.is_healthy
    finally:
        engine.shutdown()


def test_logging_stat_logger_writes_one_line_per_interval():
    from pagedllm.engine.stats import EngineStats

    def stats(prompt: int, generated: int, running: int, steps: int) -> EngineStats:
        zero = dict.fromkeys(EngineStats.__dataclass_fields__, 0)
        return EngineStats(**{**zero, "num_prompt_tokens": prompt, "num_generation_tokens": generated,
                              "num_running": running, "num_steps": steps, "kv_cache_usage": 0.25})

    lines: list[str] = []
    log = LoggingStatLogger(interval_s=5.0, log=lines.append)
    log.record(stats(0, 0, 0, 0), IterationStats(now=100.0))
    log.record(stats(100, 50, 3, 10), IterationStats(now=102.0))  # inside the interval
    log.record(stats(500, 1000, 3, 90), IterationStats(now=105.0))
    log.record(stats(500, 1000, 0, 90), IterationStats(now=111.0))  # idle, nothing new: quiet
    assert lines == [
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 200.0 tokens/s, Running: 3 reqs, "
        "Swapped: 0 reqs, Waiting: 0 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 0.0%"
    ]


def test_the_engine_is_built_on_the_thread_that_steps_it(tiny_llama, prompts, expected, monkeypatch):
    """Loading on one thread and stepping on another gives the process two OpenMP pools, and
    libgomp's workers then sleep between parallel regions (a served step took twice as long)."""
    import threading

    from pagedllm.engine.llm_engine import LLMEngine

    built_on, stepped_on = [], set()
    build, step = LLMEngine.from_engine_args.__func__, LLMEngine.step

    def recording_build(cls, args):
        built_on.append(threading.get_ident())
        return build(cls, args)

    def recording_step(self):
        stepped_on.add(threading.get_ident())
        return step(self)

    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(recording_build))
    monkeypatch.setattr(LLMEngine, "step", recording_step)
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), **ENGINE_KWARGS))
    try:
        out = asyncio.run(collect(engine, prompts[0], GREEDY, "thread-check"))
        assert out[-1].outputs[0].token_ids == expected[0]
    finally:
        engine.shutdown()
    assert len(built_on) == 1 and built_on[0] != threading.get_ident()
    assert stepped_on == {built_on[0]}


def test_an_engine_that_fails_to_build_raises_to_the_caller(tmp_path):
    with pytest.raises(Exception, match="does-not-exist"):
        AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tmp_path / "does-not-exist")))
