"""The compiled-grammar cache (pagedllm.engine.constraints) on a tiny random model: bounded by
bytes (every live grammar charged its own size, whatever else the process allocates meanwhile),
a request given the very grammar its check compiled, failures kept small, compiles past the
time limit abandoned without holding the compile thread."""

from __future__ import annotations

import dataclasses
import itertools
from concurrent.futures import Future

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), max_model_len=256, num_gpu_blocks=256)


def test_the_grammar_cache_keeps_the_most_recently_used_and_no_more(llm, monkeypatch):
    """A client sending ever new schemas must not grow the server's memory without end."""
    from pagedllm.engine import constraints as constraints_module

    monkeypatch.setattr(constraints_module, "MAX_CACHED_GRAMMARS", 3)
    cache = llm.llm_engine.constraints
    specs = [StructuredOutputsParams(regex=f"[a-c]{{{n}}}") for n in range(1, 6)]
    futures = [cache.compile(spec) for spec in specs[:3]]
    [future.result() for future in futures]

    def again(spec):  # an equal spec, as the next request brings (the spec object keeps its own)
        return cache.compile(dataclasses.replace(spec))

    assert again(specs[0]) is futures[0]  # reused, and now the most recently used
    for spec in specs[3:]:
        cache.compile(spec).result()
    assert len(cache._compiled) == 3 and len(cache.compile_seconds) <= 3
    assert again(specs[0]) is futures[0]  # kept: the least recently used ones went
    recompiled = again(specs[1])
    assert recompiled is not futures[1] and recompiled.result() is not None


def _choices(seed: int, count: int) -> StructuredOutputsParams:
    import random

    rng = random.Random(seed)
    return StructuredOutputsParams(choice=["".join(rng.choice("abcdefghij") for _ in range(8)) for _ in range(count)])


def _grammar_bytes(cache, spec) -> int:
    """What the cache charges for `spec`'s grammar (compiled now if it is not cached)."""
    from pagedllm.engine.constraints import spec_key

    cache.compile(spec).result()
    return cache._sizes[spec_key(spec)]


def test_the_grammar_cache_keeps_within_its_byte_budget(llm, monkeypatch):
    """Memory bounded by bytes, not entries: grammars of a few MiB each, a budget of 2.5 of them."""
    cache = llm.llm_engine.constraints
    size = _grammar_bytes(cache, _choices(100, 2000))
    monkeypatch.setattr(cache, "cache_bytes", int(2.5 * size))
    cache._evict()
    from pagedllm.engine.constraints import spec_key

    specs = [_choices(seed, 2000) for seed in range(101, 106)]
    for spec in specs:
        cache.compile(spec).result()
        assert 0 < cache.cached_bytes <= cache.live_bytes <= cache.cache_bytes
    kept = [spec for spec in specs if spec_key(spec) in cache._compiled]
    assert kept == specs[-2:] and cache.cached_bytes == sum(cache._sizes.values())


def test_a_grammar_is_charged_its_own_bytes_whatever_else_the_process_allocates(llm, monkeypatch):
    """At least what a compile takes from the C allocator in a quiet process (xgrammar's own
    measure leaves out a fifth of it), and no more than half again as much when other work
    allocates 256 MiB meanwhile (the heap's growth was charged, and valid grammars of a few MiB
    were refused as 72-130 MiB on a busy server)."""
    from pagedllm.utils import heap_bytes_in_use, release_free_memory

    cache = llm.llm_engine.constraints
    cache.compile(StructuredOutputsParams(regex="[ab]")).result()  # the compiler is built
    release_free_memory()
    before = heap_bytes_in_use()
    quiet = cache._compiler.compile(_choices(600, 2000))
    took = heap_bytes_in_use() - before
    del quiet
    others = []
    compile_grammar = cache._compiler.compile
    monkeypatch.setattr(cache._compiler, "compile", lambda spec: (others.append(bytearray(256 << 20)), compile_grammar(spec))[1])
    charged = _grammar_bytes(cache, _choices(601, 2000))
    assert others and took <= charged <= 1.5 * took, (took, charged)


def test_a_request_is_given_the_grammar_its_check_compiled(llm, monkeypatch):
    """The server checks a request's grammar before adding it; if the cache lets the grammar go
    in between, the request still gets it: compiling it again could fail on a busier server (past
    the budget or the time limit), and failed an accepted request with a 500."""
    from pagedllm.engine.constraints import ConstraintLimitError, spec_key

    engine = llm.llm_engine
    cache = engine.constraints
    spec = StructuredOutputsParams(choice=["alpha", "beta", "gamma"])
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec)
    engine.check_constraints(params)
    size = _grammar_bytes(cache, _choices(701, 2000))
    monkeypatch.setattr(cache, "cache_bytes", int(1.5 * size))
    _grammar_bytes(cache, _choices(702, 2000))  # the checked grammar leaves the cache
    assert spec_key(spec) not in cache._compiled
    compiles = []

    def busy(spec):
        compiles.append(spec)
        raise ConstraintLimitError("the server is busy", spec.param)

    monkeypatch.setattr(cache._compiler, "compile", busy)
    engine.add_request("checked", [5, 6, 7], params)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["checked"].error is None and finished["checked"].outputs[0].text in spec.choice
    assert compiles == []


def _refused(cache, spec) -> str:
    try:
        cache.wait_compiled(spec)
    except ValueError as exc:
        return str(exc)
    return ""


def test_a_refused_grammar_keeps_nothing_of_its_spec(llm, monkeypatch):
    """A spec refused over the budget stays cached as a failure (the same spec fails at once
    after): a few hundred bytes, not its spec (each refusal kept ~4 MiB through the failure's
    traceback and a key holding the spec's text, past the byte budget's count)."""
    import gc
    import weakref

    from pagedllm.engine.constraints import spec_key

    cache = llm.llm_engine.constraints
    monkeypatch.setattr(cache, "cache_bytes", 100_000)
    spec = _choices(703, 2000)
    key, spec_alive = spec_key(spec), weakref.ref(spec)
    assert "structured_outputs_cache_bytes" in _refused(cache, spec)
    assert "structured_outputs_cache_bytes" in _refused(cache, spec)  # at once, from the cache
    failure = cache._compiled[key].exception()
    del spec
    gc.collect()
    assert spec_alive() is None
    assert failure.__traceback__ is None and failure.__context__ is None
    assert len(repr(key)) < 100


def test_a_grammar_a_request_still_holds_counts_against_the_budget(llm, monkeypatch):
    """Evicted from the cache but held by a running request, a grammar is still in memory: the
    cache makes room for it, and lets it go from the count once the request drops it."""
    cache = llm.llm_engine.constraints
    size = _grammar_bytes(cache, _choices(300, 2000))
    monkeypatch.setattr(cache, "cache_bytes", int(2.5 * size))
    cache._evict()
    from pagedllm.engine.constraints import spec_key

    held = cache.compile(_choices(301, 2000)).result()  # as a running request's constraint holds it
    live_with_held = None
    specs = [_choices(seed, 2000) for seed in range(302, 305)]
    for spec in specs:
        cache.compile(spec).result()
        assert cache.live_bytes <= cache.cache_bytes
        live_with_held = cache.live_bytes
    kept = [spec for spec in specs if spec_key(spec) in cache._compiled]
    assert kept == specs[-1:]  # the held grammar takes the room of a second cached one
    del held
    assert cache.live_bytes < live_with_held


def test_room_is_left_for_the_grammar_being_compiled(llm, monkeypatch):
    """While a grammar compiles, the cache already holds no more than the budget less the size of
    a recent grammar: the one in flight fits beside it."""
    cache = llm.llm_engine.constraints
    size = _grammar_bytes(cache, _choices(400, 2000))
    monkeypatch.setattr(cache, "cache_bytes", int(2.5 * size))
    for seed in (401, 402):
        cache.compile(_choices(seed, 2000)).result()
    seen = []
    compile_grammar = cache._compiler.compile
    monkeypatch.setattr(cache._compiler, "compile", lambda spec: (seen.append(cache.live_bytes), compile_grammar(spec))[1])
    cache.compile(_choices(403, 2000)).result()
    assert seen and seen[0] + size * 0.9 <= cache.cache_bytes


def test_a_grammar_larger_than_the_whole_cache_is_refused_naming_the_limit(llm, monkeypatch):
    monkeypatch.setattr(llm.llm_engine.constraints, "cache_bytes", 100_000)
    with pytest.raises(ValueError, match="structured_outputs_cache_bytes") as error:
        llm.generate([[5, 6, 7]], SamplingParams(structured_outputs=_choices(7, 2000)), use_tqdm=False)
    assert error.value.param == "structured_outputs.choice"
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_grammar_past_the_compile_time_limit_fails_its_request_only(llm, monkeypatch):
    engine = llm.llm_engine
    never: Future = Future()
    monkeypatch.setattr(engine.constraints, "compile", lambda spec, pin=False: never)
    monkeypatch.setattr(engine.constraints, "compile_seconds_limit", 0.2)
    spec = StructuredOutputsParams(regex="[0-9]{4}")
    with pytest.raises(ValueError, match="did not compile within 0.2 s.*structured_outputs_compile_seconds") as error:
        llm.generate([[5, 6, 7]], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert error.value.param == "structured_outputs.regex"
    engine.add_request("slow", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, structured_outputs=spec))
    engine.add_request("free", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "did not compile within" in finished["slow"].error and len(finished["free"].outputs[0].token_ids) == 4


_RUNAWAY_DIGITS = itertools.count(5)


@pytest.fixture
def runaway_compile(llm, monkeypatch):
    """A compile of a regex ("[0-9]{N}", N new each time) that runs until the test releases it
    (as a grammar that takes minutes), under a compile-time limit of 0.2 s; yields the spec and
    the release."""
    import threading

    cache = llm.llm_engine.constraints
    cache.compile(StructuredOutputsParams(regex="[ab]")).result()  # the compiler is built
    release = threading.Event()
    regex = f"[0-9]{{{next(_RUNAWAY_DIGITS)}}}"
    compile_grammar = cache._compiler.compile

    def compile(spec):
        if spec.kind == "regex" and spec.regex == regex:
            release.wait(60)
        return compile_grammar(spec)

    monkeypatch.setattr(cache._compiler, "compile", compile)
    monkeypatch.setattr(cache, "compile_seconds_limit", 0.2)
    yield StructuredOutputsParams(regex=regex), release
    release.set()


def _compiles_promptly(cache, seed: int) -> bool:
    return cache.compile(_choices(seed, 20)).exception(timeout=5) is None


def test_a_compile_past_the_limit_leaves_the_compile_thread_to_the_next_grammar(llm, runaway_compile):
    """xgrammar cannot stop a compile: the request past the limit fails naming it, the compile
    runs on on a retired thread, and the next grammar compiles at once on a fresh one."""
    slow, release = runaway_compile
    engine = llm.llm_engine
    engine.add_request("slow", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, structured_outputs=slow))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "did not compile within 0.2 s" in finished["slow"].error
    assert not release.is_set() and _compiles_promptly(engine.constraints, 500)


def test_a_spec_past_the_limit_fails_at_once_after_and_its_late_result_is_dropped(llm, runaway_compile):
    import time

    from pagedllm.engine.constraints import spec_key

    slow, release = runaway_compile
    cache = llm.llm_engine.constraints
    with pytest.raises(ValueError, match="structured_outputs_compile_seconds") as error:
        cache.wait_compiled(slow)
    assert error.value.param == "structured_outputs.regex"
    start = time.monotonic()
    with pytest.raises(ValueError, match="did not compile within 0.2 s"):
        cache.wait_compiled(slow)
    assert time.monotonic() - start < 0.1 and _compiles_promptly(cache, 501)
    release.set()
    deadline = time.monotonic() + 10
    while cache._compile_thread.num_retired and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cache._compile_thread.num_retired == 0 and spec_key(slow) not in cache._sizes
