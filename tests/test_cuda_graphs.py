"""Decode and verify steps through CUDA graphs' static buffers, and swaps on a side stream.

On a GPU (marked `gpu`) the engine captures its graphs itself and its greedy tokens must equal
the reference backend's and an eager run's. On a CPU the same static-buffer path runs in
Triton's interpreter without capture (`DecodeGraphs(capture=False)`): batches padded to a
bucket, padding rows that must write nothing, the fixed flash-decoding split, block tables as
wide as the context; with speculative decoding, buckets q rows wide per sequence whose tokens
sit after padding rows. The swap test needs a GPU: on a CPU swaps are plain copies, tested in
tests/test_preemption.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.attention import AttentionMetadata  # noqa: E402
from pagedllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedllm.core.scheduler_output import ScheduledSequence  # noqa: E402
from pagedllm.kernels.triton_attention import INTERPRETED  # noqa: E402
from pagedllm.model.rotary import RotaryEmbedding  # noqa: E402
from pagedllm.worker.cache_engine import contiguous_runs  # noqa: E402
from pagedllm.worker.cuda_graphs import DecodeGraphs, capture_sizes, graph_buckets, query_widths  # noqa: E402
from tests.helpers import random_prompts  # noqa: E402


@pytest.fixture
def device(triton_device):
    return triton_device


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(4) == (1, 2, 4)
    assert capture_sizes(5) == (1, 2, 4, 8)
    assert capture_sizes(100)[-3:] == (80, 96, 112)
    assert capture_sizes(256)[-1] == 256 and capture_sizes(1000)[-1] == 256


def test_contiguous_runs_merge_consecutive_pairs_only():
    assert contiguous_runs([(5, 9), (3, 7), (4, 8), (10, 1)]) == [(3, 7, 3), (10, 1, 1)]
    assert contiguous_runs([(1, 2), (2, 4)]) == [(1, 2, 1), (2, 4, 1)]  # destinations not consecutive
    assert contiguous_runs([]) == []


def test_negative_slots_are_padding_and_not_written(device):
    backend = TritonAttentionBackend(device)
    shape = backend.kv_cache_shape(4, 8, 2, 16)
    key_cache, value_cache = (torch.full(shape, 7.0, device=device) for _ in range(2))
    key, value = (torch.randn(3, 2, 16, device=device) for _ in range(2))
    slots = torch.tensor([5, -1, 17], device=device)
    metadata = AttentionMetadata(slot_mapping=slots, query_start_loc=None, seq_lens=None, block_tables=None,
                                 query_lens=[1, 1, 1], seq_lens_list=[1, 1, 1], block_size=8)
    backend.write_kv(key, value, key_cache, value_cache, metadata)
    expected_keys = torch.full(shape, 7.0, device=device)
    expected_keys[0, :, 5] = key[0]
    expected_keys[2, :, 1] = key[2]
    assert torch.equal(key_cache, expected_keys)
    assert (value_cache == 7.0).sum() == value_cache.numel() - 2 * 2 * 16


def _generate(llm, prompts):
    # Different lengths end sequences at different steps: batches of 3, 2, 1 run padded to buckets.
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 7, 3)]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


COMMON = dict(dtype="float32", max_model_len=64, num_gpu_blocks=40, block_size=8, max_num_seqs=4)


def _through_static_buffers(device, path, prompts, generate=_generate, speculative_config=None, proposer=None):
    """(the reference backend's greedy tokens, without speculation; the Triton engine's, with
    `speculative_config` (and `proposer(prompts, expected)` in place of its proposer); its decode
    graphs or their CPU stand-in; the engine)."""
    common = dict(device=device.type, **COMMON)
    expected = generate(LLM(str(path), attention_backend="reference", **common), prompts)
    llm = LLM(str(path), attention_backend="triton", speculative_config=speculative_config, **common)
    worker = llm.llm_engine.executor.worker
    if device.type == "cpu":  # no capture on a CPU: the same buffers, run eagerly
        assert worker.runner.graphs is None
        k = speculative_config["num_speculative_tokens"] if speculative_config else None
        worker.runner.graphs = DecodeGraphs(worker.model, worker.backend, 8, 64, 4, device, capture=False,
                                            num_speculative_tokens=k)
    if proposer is not None:
        llm.llm_engine.speculator.proposer = proposer(prompts, expected)
    graphs = worker.runner.graphs
    return expected, generate(llm, prompts), graphs, llm


def test_decode_steps_through_static_buffers_equal_the_reference_backend(device, tiny_llama):
    prompts = random_prompts(3, [5, 19, 33], seed=91)
    expected, got, graphs, _ = _through_static_buffers(device, tiny_llama, prompts)
    assert graphs.sizes == (1, 2, 4)
    assert got == expected
    assert graphs.replays >= 11  # every decode step: 11 for the longest output

    if device.type == "cuda":
        eager = LLM(str(tiny_llama), attention_backend="triton", enforce_eager=True, device="cuda", **COMMON)
        assert eager.llm_engine.executor.worker.runner.graphs is None
        assert _generate(eager, prompts) == expected


@pytest.mark.parametrize(
    "arch, overrides",
    [("mistral", {"sliding_window": 9}), ("qwen2", {"use_sliding_window": True, "sliding_window": 9, "max_window_layers": 1})],
    ids=["mistral", "qwen2-hybrid"],
)
def test_windowed_models_decode_through_static_buffers(device, tiny_models, arch, overrides):
    """Every layer sliding (one KV cache group) and a hybrid (a full and a windowed group, each
    with its own static slots, block tables and flash-decoding split), past the window: the same
    greedy tokens as the reference backend."""
    prompts = random_prompts(3, [5, 19, 33], seed=92)
    expected, got, graphs, llm = _through_static_buffers(device, tiny_models(arch, **overrides), prompts)
    assert graphs.group_windows == ([9] if arch == "mistral" else [None, 9])
    assert got == expected
    assert graphs.replays >= 11 and llm.llm_engine.block_manager.num_window_frees > 0


# --- steps verifying proposed tokens (speculative decoding) ---------------------------------

SPECULATION = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2, "prompt_lookup_min": 1,
               "adaptive": False}  # every proposal verified


def test_verify_buckets_widths_and_token_cap():
    assert graph_buckets(4) == {1: (1, 2, 4)}  # no speculation: the decode graphs alone
    assert query_widths(4) == (1, 2, 4, 5) and query_widths(3) == (1, 2, 4) and query_widths(1) == (1, 2)
    buckets = graph_buckets(256, 8)
    assert list(buckets) == [1, 2, 4, 8, 9] and buckets[1] == buckets[2] == buckets[4] == capture_sizes(256)
    assert buckets[8][-1] == 128 and buckets[9][-1] == 112  # size * q <= 1024
    assert graph_buckets(256, 8, max_tokens=64) == {1: capture_sizes(256), 2: (1, 2, 4, 8, 16, 24, 32),
                                                    4: (1, 2, 4, 8, 16), 8: (1, 2, 4, 8), 9: (1, 2, 4)}


class _EchoModel:
    """A model stand-in over the Triton backend's plans: hidden row r is input token r, and the
    metadata of the last forward pass is kept. Two KV cache groups, the second windowed."""

    def __init__(self):
        self.attention_layers = [SimpleNamespace(num_heads=6, num_kv_heads=1, head_dim=16, kv_cache_group=g,
                                                 sliding_window=window) for g, window in enumerate((None, 9))]

    def __call__(self, input_ids, positions, metadata):
        self.metadata = metadata
        return input_ids[:, None].float()


def _verifying(token_ids, draft_token_ids, start_position, block_table, other_table):
    return ScheduledSequence(seq_id=start_position, request_id="", token_ids=token_ids, start_position=start_position,
                             block_table=block_table, sampling_params=None, other_block_tables=[other_table],
                             draft_token_ids=draft_token_ids)


def test_verify_step_layout_pads_each_sequence_before_its_tokens():
    """Query lengths 1, 3, 2 in a q=4 bucket of 4 sequences: each sequence's tokens are the last
    rows of its 4, every other row is padding (token 0, position 0, slot -1 in both groups), and
    the work items cover exactly the real tokens."""
    model = _EchoModel()
    graphs = DecodeGraphs(model, TritonAttentionBackend("cpu"), 8, 64, 4, torch.device("cpu"), capture=False,
                          num_speculative_tokens=3)
    items = [
        _verifying([11], [], 5, [3], [4]),  # a decode at position 5
        _verifying([21, 22, 23], [22, 23], 9, [0, 7], [None, 6]),  # positions 9-11: block 7
        _verifying([31, 32], [32], 15, [1, 2, 3], [5, 8, 10]),  # positions 15 (block 2), 16 (block 3)
    ]
    assert graphs.applies(items) and graphs.width(items) == 4 and graphs.bucket(3, 4) == 4
    hidden, query_lens = graphs.run(items)
    pad = -1
    assert graphs.input_ids[:16].tolist() == [0, 0, 0, 11, 0, 21, 22, 23, 0, 0, 31, 32, 0, 0, 0, 0]
    assert graphs.positions[:16].tolist() == [0, 0, 0, 5, 0, 9, 10, 11, 0, 0, 15, 16, 0, 0, 0, 0]
    assert graphs.slot_mappings[0][:16].tolist() == [pad] * 3 + [29, pad, 57, 58, 59, pad, pad, 23, 24] + [pad] * 4
    assert graphs.slot_mappings[1][:16].tolist() == [pad] * 3 + [37, pad, 49, 50, 51, pad, pad, 71, 80] + [pad] * 4
    assert graphs.seq_lens[:4].tolist() == [6, 12, 17, 0]
    # (sequence, first row, tokens, first position); the padding sequence has no token.
    assert graphs.items[:4].tolist() == [[0, 3, 1, 5], [1, 5, 3, 9], [2, 10, 2, 15], [3, 12, 0, 0]]
    covered = {row for _, first, n, _ in graphs.items[:4].tolist() for row in range(first, first + n)}
    assert covered == {row for row, slot in enumerate(graphs.slot_mappings[0][:16].tolist()) if slot >= 0}
    # Both groups' plans take 4 tokens of a GQA group of 6 per program (24 rows; a decode's 16),
    # over the same items.
    assert graphs.metadata[4, 1].backend_plan.block_m == 16
    for metadata in (model.metadata, model.metadata.other_groups[0]):
        plan = metadata.backend_plan
        assert plan.block_m == 32 and plan.items.data_ptr() == graphs.items.data_ptr()
        assert metadata.query_lens == [4] * 4 and metadata.slot_mapping.shape == (16,)
    # The runner's rows of each sequence (the last 1 + k of its q) are its tokens.
    assert query_lens == [4, 4, 4] and hidden.shape == (12, 1)
    starts = [0, 4, 8, 12]
    for i, item in enumerate(items):
        rows = range(starts[i + 1] - 1 - len(item.draft_token_ids), starts[i + 1])
        assert hidden[list(rows), 0].tolist() == item.token_ids
    assert graphs.replays == 1 and graphs.replays_by_width == {4: 1}


def test_steps_that_are_not_decodes_or_verifications_run_eagerly():
    graphs = DecodeGraphs(_EchoModel(), TritonAttentionBackend("cpu"), 8, 64, 4, torch.device("cpu"), capture=False,
                          num_speculative_tokens=3)
    decode = _verifying([11], [], 5, [3], [4])
    assert graphs.applies([decode] * 4)
    assert not graphs.applies([decode] * 5)  # past the largest bucket
    assert not graphs.applies([decode, _verifying([1, 2, 3], [], 0, [0], [1])])  # a prompt chunk
    assert not graphs.applies([_verifying([1, 2, 3, 4, 5], [2, 3, 4, 5], 0, [0], [1])])  # wider than q=4
    logprobs = _verifying([11], [], 5, [3], [4])
    logprobs.prompt_logprob_targets = [7]
    assert not graphs.applies([decode, logprobs])
    assert not graphs.applies([_verifying([11], [], 70, list(range(9)), list(range(9)))])  # past max_model_len
    assert graphs.replays == 0


def test_longrope_tables_in_a_verify_bucket_follow_each_sequence_length():
    """A bucket's sequences are all q rows wide: LongRoPE's per-token lengths come from expanding
    the sequence lengths (a graph cannot wait for the host's repeat counts), short table below
    the pretraining length, long above."""
    scaling = {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 8,
               "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    rotary = RotaryEmbedding(16, 64, 10000.0, scaling, torch.float32)
    metadata = SimpleNamespace(query_lens=[3, 3], num_decodes=0, seq_lens=torch.tensor([5, 12]), max_seq_len=12)
    positions = torch.tensor([0, 3, 4, 9, 10, 11])  # a padding row, then sequence 0's two tokens
    assert rotary.table_positions(positions, metadata).tolist() == [0, 3, 4, 64 + 9, 64 + 10, 64 + 11]


def _generate_verifying(llm, prompts):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (14, 10, 6)]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture
def recorded_steps(monkeypatch):
    """The query lengths of every step run through the static buffers."""
    steps = []
    run = DecodeGraphs.run

    def recording_run(self, items):
        steps.append([len(item.token_ids) for item in items])
        return run(self, items)

    monkeypatch.setattr(DecodeGraphs, "run", recording_run)
    return steps


@pytest.fixture
def group_of_4_model(tiny_models):
    """A small vocabulary (outputs repeat, so n-gram proposals hit) and a GQA group of 4: the 5
    tokens of a q=5 bucket take 20 query rows of a program, past a decode program's 16."""
    return tiny_models("llama", vocab_size=64, num_key_value_heads=1)


def _check_verified_through_buckets(device, model, prompts, llm, graphs, steps, expected):
    assert list(graphs.buckets) == [1, 2, 4, 5]
    assert sum(count for width, count in graphs.replays_by_width.items() if width > 1) > 0
    assert any(len(set(lens)) > 1 and max(lens) > 1 for lens in steps)  # mixed query lengths in a bucket
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    if device.type == "cuda":
        eager = LLM(str(model), attention_backend="triton", enforce_eager=True, device="cuda",
                    speculative_config=SPECULATION, **COMMON)
        assert eager.llm_engine.executor.worker.runner.graphs is None
        assert _generate_verifying(eager, prompts) == expected


def test_ngram_verify_steps_through_static_buffers_equal_the_reference_backend(device, group_of_4_model,
                                                                               recorded_steps):
    """N-gram speculation, every proposal verified, with verify steps replayed from q > 1
    buckets (sequences of different query lengths in one): the greedy tokens of the reference
    backend without speculation, with proposals both accepted and rejected."""
    # Prompts that repeat themselves (this model continues the first), then one at random.
    prompts = [[32] * 8, [7, 60, 57, 3, 41] * 3, random_prompts(1, [13], seed=94, low=3, high=64)[0]]
    expected, got, graphs, llm = _through_static_buffers(device, group_of_4_model, prompts, _generate_verifying,
                                                         SPECULATION)
    assert got == expected
    _check_verified_through_buckets(device, group_of_4_model, prompts, llm, graphs, recorded_steps, expected)


class _OracleProposer:
    """Proposes the reference output's own continuation, wrong at the (i % 5)-th token of every
    other proposal i: accepted runs of every length, and rejections."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        self.outputs = {tuple(p): o for p, o in zip(prompts, outputs)}
        self.calls = 0
        self.match_lengths: dict[int, int] = {}  # each proposal as from a long match (where read)

    def propose(self, seq, k: int) -> list[int]:
        output = self.outputs[tuple(seq.prompt_token_ids)]
        proposal = list(output[seq.num_output_tokens : seq.num_output_tokens + k])
        self.calls += 1
        self.match_lengths[seq.seq_id] = 32
        wrong = self.calls % 5
        if self.calls % 2 and wrong < len(proposal):
            proposal[wrong] = (proposal[wrong] + 1) % 64
        return proposal

    def forget(self, live) -> None:
        pass


@pytest.mark.parametrize(
    "arch, overrides",
    [("llama", {}), ("qwen2", {"use_sliding_window": True, "sliding_window": 9, "max_window_layers": 1})],
    ids=["llama", "qwen2-hybrid"],
)
def test_long_accepted_runs_through_static_buffers_equal_the_reference_backend(device, tiny_models, arch, overrides,
                                                                               recorded_steps):
    """Proposals of up to 4 tokens accepted whole or in part: each verifying sequence's rows of
    a q=5 bucket (after padding where it proposed fewer) give the reference backend's tokens;
    also for a hybrid model past its window (each KV cache group's own slots and tables)."""
    model = tiny_models(arch, vocab_size=64, num_key_value_heads=1, **overrides)  # GQA group 4, as above
    prompts = random_prompts(3, [5, 19, 11], seed=95, low=3, high=64)
    expected, got, graphs, llm = _through_static_buffers(device, model, prompts, _generate_verifying, SPECULATION,
                                                         _OracleProposer)
    assert graphs.group_windows == ([None] if arch == "llama" else [None, 9])
    assert got == expected
    _check_verified_through_buckets(device, model, prompts, llm, graphs, recorded_steps, expected)
    assert graphs.replays_by_width[5] > 0 and llm.llm_engine.get_stats().spec_decode_num_accepted_tokens_per_pos[3] > 0
    if arch == "qwen2":
        assert llm.llm_engine.block_manager.num_window_frees > 0


@pytest.mark.gpu
def test_swap_preemption_on_the_side_stream_keeps_greedy_tokens(tiny_llama):
    if not torch.cuda.is_available() or INTERPRETED:
        pytest.skip("needs a CUDA device with compiled Triton kernels: swaps go on a CUDA stream there")
    prompts = random_prompts(6, [30, 41, 25, 50, 37, 44], seed=93)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", max_model_len=128, block_size=8, attention_backend="triton")
    roomy = LLM(str(tiny_llama), num_gpu_blocks=200, **common)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(str(tiny_llama), num_gpu_blocks=24, preemption_mode="swap", **common)
    assert tight.llm_engine.executor.worker.cache_engine.swap_stream is not None
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    stats = tight.llm_engine.get_stats()
    assert stats.num_blocks_swapped_out > 0 and stats.num_blocks_swapped_in > 0
    assert got == expected
