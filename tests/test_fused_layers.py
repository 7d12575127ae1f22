"""The decoder layers in one C++ call (`pagedllm.model.fused_layers`): bitwise the Python layer
loop's output, used only where it applies, and seen part by part by the step profile."""

from __future__ import annotations

import contextlib

import pytest
import torch

from pagedllm.bench.step_profile import profile_decode_steps
from pagedllm.kernels.gguf import MAX_ROWS
from pagedllm.model.fused_layers import FusedDecoderLayers
from pagedllm.sampling_params import SamplingParams


@contextlib.contextmanager
def _counting(fused, calls: list):
    """Each fused call's token count into `calls`: `__call__`'s, and `run_steady`'s (a decode
    step repeating the last call's inputs advanced in place)."""
    original, steady = FusedDecoderLayers.__call__, FusedDecoderLayers.run_steady

    def counted(self, *args):
        calls.append(args[1].shape[0])
        return original(self, *args)

    def counted_steady(self):
        calls.append(self._steady[2].shape[0])
        return steady(self)

    FusedDecoderLayers.__call__, FusedDecoderLayers.run_steady = counted, counted_steady
    try:
        yield
    finally:
        FusedDecoderLayers.__call__, FusedDecoderLayers.run_steady = original, steady


@contextlib.contextmanager
def _without(model):
    fused, model.fused_layers = model.fused_layers, None
    try:
        yield
    finally:
        model.fused_layers = fused


def _run(llm, prompts, params):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_fused_layers_equal_the_layer_loop_bitwise(smollm_llm):
    model = smollm_llm.llm_engine.executor.worker.model
    assert model.fused_layers is not None  # float32, CPU, quantized blocks: supported
    prompts = ["The capital of France is", "Water boils at", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True, logprobs=5)
    calls: list[int] = []
    with _counting(model.fused_layers, calls):
        fused = _run(smollm_llm, prompts, params)
        assert calls and max(calls) <= MAX_ROWS  # decode steps went through it
        assert 3 in calls  # the three sequences decoding together
        with _without(model):
            count = len(calls)
            loop = _run(smollm_llm, prompts, params)
            assert len(calls) == count  # and not through it here
    # Same sampled tokens and exactly the same log-probabilities (floats compared with ==).
    assert fused == loop


@pytest.mark.parametrize("table", ["gguf", "float32", "module"])
def test_the_fused_call_looks_tokens_up_as_the_embedding_does(smollm_llm, monkeypatch, table):
    """The C++ call looks its rows up itself in a GGUF-packed token table (the default model's) or
    a float32 one, else has the embedding module do it: each way bitwise the layer loop's run."""
    import torch

    from pagedllm.kernels import gguf
    from pagedllm.model import fused_layers

    model = smollm_llm.llm_engine.executor.worker.model
    fused = model.fused_layers
    embedding = model.model.embed_tokens
    (packed,) = embedding.quant_method.fused_parts
    assert fused_layers._token_table(embedding)[0] == gguf.TYPE_IDS[packed.qtype]
    if table == "float32":
        rows = gguf.dequantize_rows(packed)
        monkeypatch.setattr(fused_layers, "_token_table", lambda _: (-1, rows.data_ptr(), rows.shape[0]))
    elif table == "module":
        monkeypatch.setattr(fused_layers, "_token_table", lambda _: None)
    fused._bound_to = None  # (the layers' pointers and the table taken again)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True, logprobs=3)
    calls: list[int] = []
    try:
        with _counting(fused, calls):
            ours = _run(smollm_llm, prompts, params)
            assert 2 in calls and (fused._table is None) == (table == "module")
            assert table != "float32" or fused._table[0] == -1
            with _without(model):
                assert ours == _run(smollm_llm, prompts, params)
        if table == "gguf":  # an id outside the vocabulary: an error, nothing computed
            metadata, positions = fused._step_inputs
            with pytest.raises(ValueError, match=f"in \\[0, {packed.out_features}\\)"):
                fused(positions, torch.full((positions.shape[0],), packed.out_features), metadata)
    finally:
        monkeypatch.undo()
        fused._bound_to = None


def test_prompts_and_large_batches_take_the_loop(smollm_llm, monkeypatch):
    engine = smollm_llm.llm_engine
    model = engine.executor.worker.model
    calls: list[int] = []
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    # No step-time budget: the prompts all run in one step, so that their decodes do too (with
    # it, what earlier tests taught the shared engine could spread them over steps).
    monkeypatch.setattr(engine.step_budget, "max_step_seconds", None)
    with _counting(model.fused_layers, calls):
        smollm_llm.generate([[200 + i for i in range(40)]], params, use_tqdm=False)
        # one prompt of 40 fresh tokens: the loop (torch's causal attention); its one decode: fused
        assert calls == [1]
        calls.clear()
        smollm_llm.generate([[300 + i, 301 + i] for i in range(MAX_ROWS + 1)], params, use_tqdm=False)
        assert calls == []  # the prompts, and the batch of MAX_ROWS + 1 decodes, ran in the loop


def test_unsupported_models_have_no_fused_path(tiny_llama):
    from pagedllm.entrypoints.llm import LLM

    # A safetensors model has no quantized blocks; batch-invariant mode keeps its own order.
    for kwargs in ({"model": str(tiny_llama)}, {"batch_invariant": True}):
        llm = LLM(max_model_len=128, num_gpu_blocks=32, **kwargs)
        try:
            assert llm.llm_engine.executor.worker.model.fused_layers is None
        finally:
            llm.llm_engine.shutdown()


def test_the_step_profile_sees_the_fused_parts(smollm_llm):
    engine = smollm_llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"profile-{i}", [400 + i + j for j in range(16)], params)
    engine.step()  # the prompts
    steps, parts, calls = profile_decode_steps(engine, 3)
    fused = engine.executor.worker.model.fused_layers
    assert fused.part_ns is None  # handed back
    layers = engine.executor.worker.model.cfg.num_layers
    assert calls["attention"] == calls["rotary"] == calls["kv_write"] == layers * len(steps)
    assert calls["projections"] == 4 * layers * len(steps)
    assert calls["embedding"] == len(steps) and parts["embedding"] > 0  # the lookup inside the call, once a step
    assert "fused_layers" not in calls and "fused_layers" not in parts
    for part in ("norms", "projections", "rotary", "kv_write", "attention", "mlp_activation", "copies"):
        assert parts[part] > 0, part
    assert calls["copies"] == layers * len(steps)  # (q, k and v gathered once a layer, C++ time out of `other`)
    assert parts["projections"] > parts["norms"]  # the C++ timers, not zeros or the whole call
    assert parts["other"] >= 0 and sum(parts.values()) == pytest.approx(sum(steps))
    while engine.has_unfinished_requests():
        engine.step()


def test_windowed_layers_fused_equal_the_layer_loop_bitwise():
    """The default model with a 24-token window set on every layer (its KV cache manager still
    keeps every block: only attention changes): decode steps past the window through the C++
    layer loop, each layer reading only its window, give exactly the Python loop's tokens and
    log-probabilities, and not those of full attention."""
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(kv_cache_memory=64 << 20, max_model_len=256)
    model = llm.llm_engine.executor.worker.model
    prompts = [[500 + 7 * i + j for j in range(30 + 5 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True, logprobs=3)
    full = _run(llm, prompts, params)
    for layer in model.model.layers:
        layer.self_attn.attn.sliding_window = 24
    model.model.fused_layers._bound_to = None  # the layers' windows are read when their pointers are
    calls: list[int] = []
    with _counting(model.model.fused_layers, calls):
        fused = _run(llm, prompts, params)
        assert 3 in calls
        with _without(model):
            count = len(calls)
            loop = _run(llm, prompts, params)
            assert len(calls) == count
    assert fused == loop and fused != full
    llm.llm_engine.shutdown()


def test_fused_layers_address_each_kv_cache_groups_own_blocks():
    """The default model laid out as a hybrid by hand: layers 0-14 a full-attention group, layers
    15-29 a windowed group (window 24) sharing their tensors (layer i and layer 15 + i use the
    same pools) with block tables and slots of their own. A prompt chunk and decode steps through
    the C++ layer loop write and read exactly what the Python loop does, bit for bit."""
    import torch

    from pagedllm.core.scheduler_output import ScheduledSequence
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.worker.cache_engine import CacheEngine
    from pagedllm.worker.model_runner import build_attention_metadata

    llm = LLM(kv_cache_memory=16 << 20, max_model_len=256)
    worker = llm.llm_engine.executor.worker
    model, layers = worker.model, worker.model.model.layers
    half = len(layers) // 2
    cache = CacheEngine(worker.backend, half, worker.num_kv_heads, worker.head_dim, 16, 64, 0, torch.float32,
                        torch.device("cpu"))
    model.bind_kv_cache([cache.key_caches[i % half] for i in range(2 * half)],
                        [cache.value_caches[i % half] for i in range(2 * half)], [i // half for i in range(2 * half)])
    for layer in layers[half:]:
        layer.self_attn.attn.sliding_window = 24
    fused = model.model.fused_layers
    fused._bound_to = None
    prompts = [[600 + 3 * i + j for j in range(40 + 9 * i)] for i in range(3)]
    tables = [(list(range(8 * i, 8 * i + 8)), list(range(32 + 8 * i, 40 + 8 * i))) for i in range(3)]

    def run(lengths_done, tokens, which=(0, 1, 2)):
        """One step (the next tokens of the sequences `which`) with the fused path, then the
        loop, from the same cache; the loop's cache is kept."""
        items = [ScheduledSequence(seq_id=i, request_id=str(i), token_ids=tokens[i], start_position=lengths_done[i],
                                   block_table=tables[i][0], sampling_params=None, other_block_tables=[tables[i][1]])
                 for i in which]
        saved = [t.clone() for t in cache.key_caches + cache.value_caches]
        outs = []
        for use_fused in (True, False):
            for tensor, before in zip(cache.key_caches + cache.value_caches, saved):
                tensor.copy_(before)
            input_ids, positions, metadata = build_attention_metadata(items, 16, torch.device("cpu"))
            with torch.inference_mode():
                model.model.fused_layers = fused if use_fused else None
                outs.append(model(input_ids, positions, metadata))
        model.model.fused_layers = fused
        return outs

    calls: list[int] = []
    with _counting(fused, calls):
        fresh, loop = run([0, 0, 0], [p[:1] for p in prompts])  # one token each: decodes of a 1-token context
        assert torch.equal(fresh, loop)
        done = [1, 1, 1]
        chunk = [p[1:] for p in prompts]  # chunks over a cached context: past the window, through the kernel
        run(done, chunk)
        done = [len(p) for p in prompts]
        # Decodes of 3, 2, 3, 1 and 3 sequences: the fused call's kept step struct, scratch and
        # pointer arrays follow the batch's size and tensors.
        for step, which in enumerate([(0, 1, 2), (0, 2), (0, 1, 2), (1,), (0, 1, 2)]):
            a, b = run(done, [[700 + step + i] for i in range(3)], which)
            assert torch.equal(a, b)
            done = [d + (i in which) for i, d in enumerate(done)]
    assert len(calls) >= 6  # the decode steps (and the first) went through the fused call
    llm.llm_engine.shutdown()


def _counting_head(monkeypatch) -> list[tuple[int, bool]]:
    """(rows, whether it drew any top-k row) of each call of the head's sampling product."""
    from pagedllm.kernels import gguf

    calls: list[tuple[int, bool]] = []
    original = gguf._SampleCall.__call__

    def counted(call):  # (matmul_sample's calls and greedy_sampler's kept ones all run here)
        draws = call.held[3]
        calls.append((len(call.tokens), draws is not None and bool((draws.top_k > 0).any())))
        return original(call)

    monkeypatch.setattr(gguf._SampleCall, "__call__", counted)
    return calls


def _tokens_and_logprobs(outputs) -> list[tuple[list[int], float]]:
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outputs]


def test_greedy_tokens_from_the_heads_product_equal_the_samplers(smollm_llm, monkeypatch):
    """A batch of plain greedy rows takes its tokens and log-probabilities from the LM head's
    product (kernels.gguf.matmul_sample, no logits read back): the same tokens and cumulative
    log-probabilities (floats compared with ==) as the logits then the sampler, which a batch
    asking for log-probabilities still takes. Whether the head draws for the model's hidden
    states is asked of the model once, not each step (`ModelRunner._samples_in_head`)."""
    runner = smollm_llm.llm_engine.executor.worker.runner
    model = runner.model
    prompts = ["The capital of France is", "Water boils at", "def fibonacci(n):"]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    calls = _counting_head(monkeypatch)
    asked = []
    original = type(model).samples_in_head

    def counted(self, hidden):
        asked.append(hidden.shape[0])
        return original(self, hidden)

    monkeypatch.setattr(type(model), "samples_in_head", counted)
    head = _tokens_and_logprobs(smollm_llm.generate(prompts, greedy, use_tqdm=False))
    assert (3, False) in calls  # the three sequences' decode steps took it
    assert runner._samples_in_head is True and len(asked) <= 1  # (0: an earlier test's step asked it)
    count = len(calls)
    with monkeypatch.context() as m:
        m.setattr(runner, "_samples_in_head", False)
        assert head == _tokens_and_logprobs(smollm_llm.generate(prompts, greedy, use_tqdm=False))
    assert len(calls) == count  # not taken there
    smollm_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, logprobs=2), use_tqdm=False)
    assert len(calls) == count  # the logits are needed: the sampler's path


def test_top_k_draws_from_the_heads_product_equal_the_samplers(smollm_llm, monkeypatch):
    """A batch of greedy and top-k rows (seeded or not, with top-p, min-p and temperatures)
    takes its draws from the LM head's product: the same tokens and cumulative log-probabilities
    as the logits then the sampler, from the same random numbers (the sampler's generator reset
    before each run: the head's path draws as many, in the same order). A random row without
    top-k needs the whole distribution: its batch takes the sampler's path."""
    runner = smollm_llm.llm_engine.executor.worker.runner
    prompts = ["The capital of France is", "Water boils at", "def fibonacci(n):", "Once upon a time"]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=40, seed=1, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.3, top_k=5, top_p=0.9, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, min_p=0.05, seed=7, max_tokens=16, ignore_eos=True)]
    calls = _counting_head(monkeypatch)

    def run(sampling):
        runner.sampler._global.manual_seed(1234)
        return _tokens_and_logprobs(smollm_llm.generate(prompts, sampling, use_tqdm=False))

    head = run(params)
    assert (4, True) in calls  # the four sequences' decode steps drew in the head
    count = len(calls)
    with monkeypatch.context() as m:
        m.setattr(runner, "_samples_in_head", False)
        assert head == run(params)
    assert len(calls) == count
    assert len({tuple(ids) for ids, _ in head[1:]}) == 3  # (draws, not one token over and over)
    run([*params[:3], SamplingParams(temperature=1.0, seed=3, max_tokens=4)])  # no top-k on the last
    assert calls[count:] and all(rows < 4 for rows, _ in calls[count:])  # (the three left, once it ended)


def test_decode_steps_draw_in_the_head_right_after_the_layers(smollm_llm, monkeypatch):
    """A step of decodes that the head serves is decided before the forward
    (`ModelRunner._head_draws`): its tokens come from the head's product called right after the
    layers, not through the rows' gathering and `_sample`, and are those of that way (greedy and
    seeded top-k rows, tokens and cumulative log-probabilities compared with ==)."""
    from pagedllm.worker.model_runner import ModelRunner

    runner = smollm_llm.llm_engine.executor.worker.runner
    # No step-time budget: the prompts all run in one step (as in the test above).
    monkeypatch.setattr(smollm_llm.llm_engine.step_budget, "max_step_seconds", None)
    prompts = ["The capital of France is", "Water boils at", "Once upon a time"]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=40, seed=1, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    sampled: list[int] = []
    original = ModelRunner._sample

    def counted(self, picked, items):
        sampled.append(len(items))
        return original(self, picked, items)

    monkeypatch.setattr(ModelRunner, "_sample", counted)

    def run():
        runner.sampler._global.manual_seed(99)
        return _tokens_and_logprobs(smollm_llm.generate(prompts, params, use_tqdm=False))

    early = run()
    assert sampled == [3]  # the prompts' step only: every decode step drew right after the layers
    sampled.clear()
    with monkeypatch.context() as m:
        m.setattr(ModelRunner, "_head_draws", lambda self, items: None)
        assert run() == early
    assert len(sampled) >= 9  # every step through `_sample` there


@pytest.mark.parametrize("sampling", ["greedy", "top_k"])
def test_steady_decode_steps_repeat_the_fused_call_and_the_heads(smollm_llm, monkeypatch, sampling):
    """A step of decodes whose inputs are the last step's advanced in place repeats the fused
    call (`FusedDecoderLayers.run_steady`), then the head's (a greedy batch's kept call), outside
    torch's inference mode: the same tokens and cumulative log-probabilities (compared with ==) as
    every step through `__call__` and `matmul_sample`, while sequences leave the batch at
    different steps (each change built anew); a batch with a seeded top-k row too."""
    from pagedllm.kernels import gguf

    monkeypatch.setattr(smollm_llm.llm_engine.step_budget, "max_step_seconds", None)
    prompts = ["The capital of France is", "Water boils at", "Once upon a time"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (14, 6, 10)]
    if sampling == "top_k":
        params[1] = SamplingParams(temperature=0.8, top_k=40, seed=7, max_tokens=6, ignore_eos=True)
    steady, inference_mode = [], []
    original = FusedDecoderLayers.run_steady

    def counted(self):
        steady.append(self._steady[2].shape[0])
        inference_mode.append(torch.is_inference_mode_enabled())
        return original(self)

    monkeypatch.setattr(FusedDecoderLayers, "run_steady", counted)
    kept = _tokens_and_logprobs(smollm_llm.generate(prompts, params, use_tqdm=False))
    # Three rows from the second decode step on, two after the second sequence ends, then one
    # (each batch's first step through `__call__`).
    assert steady.count(3) >= 3 and steady.count(2) >= 2 and steady.count(1) >= 2, steady
    assert not any(inference_mode)
    steady.clear()
    with monkeypatch.context() as m:
        m.setattr(FusedDecoderLayers, "steady", lambda self, *args: False)
        m.setattr(gguf, "greedy_sampler",
                  lambda x, w, int8=False: lambda: gguf.matmul_sample(x, w, int8, logits=False)[1:])
        assert _tokens_and_logprobs(smollm_llm.generate(prompts, params, use_tqdm=False)) == kept
    assert not steady


def test_a_steady_call_needs_the_same_inputs_and_pools(smollm_llm):
    """`steady` accepts only the last call's very input tensors and KV pools: a step of other
    inputs, or after the pools were bound anew, goes through `__call__` (which rebinds)."""
    model = smollm_llm.llm_engine.executor.worker.model
    smollm_llm.generate(["Water boils at"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    fused = model.fused_layers
    metadata, positions, input_ids = fused._steady[:3]
    assert fused.steady(positions, input_ids, metadata)
    assert not fused.steady(positions.clone(), input_ids, metadata)
    assert not fused.steady(positions, input_ids.clone(), metadata)
    attn = fused._attns[0]
    pool = attn.key_cache
    attn.key_cache = pool.clone()
    try:
        assert not fused.steady(positions, input_ids, metadata)
    finally:
        attn.key_cache = pool
    assert fused.steady(positions, input_ids, metadata)
