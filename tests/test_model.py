"""The model layer against transformers: paged forward passes of tiny Llama, Mistral and Qwen2."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.attention.reference import ReferenceAttentionBackend
from pagedllm.core.scheduler_output import ScheduledSequence
from pagedllm.model import load_model
from pagedllm.transformers_utils import resolve_model
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.model_runner import build_attention_metadata
from tests.helpers import TINY_ARCHS, load_hf, random_prompts

CPU = torch.device("cpu")


class PagedSequences:
    """Drives a model over several sequences through a paged cache whose physical blocks are
    handed out in a shuffled order (so no sequence's blocks are contiguous)."""

    def __init__(self, model, block_size: int, num_blocks: int = 512, seed: int = 0):
        self.model = model
        self.block_size = block_size
        backend = model.attention_layers[0].backend
        specs = model.kv_cache_spec()
        shape = backend.kv_cache_shape(num_blocks, block_size, specs[0].num_kv_heads, specs[0].head_dim)
        floats = {p.dtype for p in model.parameters() if p.is_floating_point()}  # (packed GGUF weights are bytes)
        dtype = torch.float32 if torch.float32 in floats else floats.pop()
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in specs]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in specs]
        model.bind_kv_cache(self.keys, self.values)
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: list[list[int]] = []
        self.lengths: list[int] = []

    def _grow(self, i: int, length: int) -> None:
        while len(self.tables[i]) * self.block_size < length:
            self.tables[i].append(self.free.pop())

    @torch.inference_mode()
    def run(self, new_tokens: list[list[int]]) -> list[torch.Tensor]:
        """Append each sequence's new tokens; returns each one's logits for them."""
        while len(self.tables) < len(new_tokens):
            self.tables.append([])
            self.lengths.append(0)
        items = []
        for i, tokens in enumerate(new_tokens):
            self._grow(i, self.lengths[i] + len(tokens))
            items.append(
                ScheduledSequence(
                    seq_id=i,
                    request_id=str(i),
                    token_ids=tokens,
                    start_position=self.lengths[i],
                    block_table=list(self.tables[i]),
                    sampling_params=SamplingParams(),
                )
            )
            self.lengths[i] += len(tokens)
        order = sorted(range(len(items)), key=lambda i: len(items[i].token_ids) != 1)
        input_ids, positions, metadata = build_attention_metadata([items[i] for i in order], self.block_size, CPU)
        logits = self.model.compute_logits(self.model(input_ids, positions, metadata))
        starts = metadata.query_start_loc.tolist()
        by_seq = {}
        for rank, i in enumerate(order):
            by_seq[i] = logits[starts[rank] : starts[rank + 1]]
        return [by_seq[i] for i in range(len(items))]


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("block_size", [1, 16, 7])
def test_paged_prefill_and_decode_match_transformers(tiny_models, arch, block_size):
    path = tiny_models(arch)
    hf = load_hf(path)
    model = load_model(resolve_model(str(path)), 256, ReferenceAttentionBackend(), torch.float32, CPU)
    prompts = random_prompts(4, [5, 17, 33, 3], seed=block_size)
    paged = PagedSequences(model, block_size)

    logits = paged.run(prompts)
    for prompt, ours in zip(prompts, logits):
        torch.testing.assert_close(ours, _hf_logits(hf, prompt), atol=1e-4, rtol=0)

    sequences = [list(p) for p in prompts]
    for _ in range(5):
        next_tokens = [int(l[-1].argmax()) for l in logits]
        for seq, token in zip(sequences, next_tokens):
            seq.append(token)
        logits = paged.run([[t] for t in next_tokens])
        for seq, ours in zip(sequences, logits):
            torch.testing.assert_close(ours[-1], _hf_logits(hf, seq)[-1], atol=1e-4, rtol=0)


def test_prefill_continuing_from_cached_context_matches(tiny_models):
    """A prompt computed in chunks (as chunked prefill and prefix-cache hits do) reads the
    earlier chunks' keys and values from the cache."""
    path = tiny_models("llama")
    hf = load_hf(path)
    model = load_model(resolve_model(str(path)), 256, ReferenceAttentionBackend(), torch.float32, CPU)
    prompt = random_prompts(1, [40], seed=7)[0]
    paged = PagedSequences(model, block_size=16)
    first = paged.run([prompt[:16]])[0]
    second = paged.run([prompt[16:]])[0]
    torch.testing.assert_close(torch.cat([first, second]), _hf_logits(hf, prompt), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": True},
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
        {"num_key_value_heads": 4},
        {"num_key_value_heads": 1},
        {"attention_bias": True, "mlp_bias": True},  # biases on all four attention projections and the MLP's
    ],
    ids=["tied", "llama3-rope", "linear-rope", "mha", "mqa", "biases"],
)
def test_llama_variants_match_transformers(tiny_models, overrides):
    path = tiny_models("llama", **overrides)
    hf = load_hf(path)
    model = load_model(resolve_model(str(path)), 512, ReferenceAttentionBackend(), torch.float32, CPU)
    prompt = random_prompts(1, [300], seed=3)[0]  # long enough for the scaled frequencies to matter
    ours = PagedSequences(model, block_size=16).run([prompt])[0]
    torch.testing.assert_close(ours, _hf_logits(hf, prompt), atol=1e-4, rtol=0)
    if overrides.get("tie_word_embeddings"):
        assert model.lm_head.weight is model.embedding_weight


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("mistral", {"sliding_window": 7}),  # every layer slides
        ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),  # layer 1 slides
    ],
    ids=["mistral", "qwen2-hybrid"],
)
def test_sliding_window_layers_match_transformers_past_the_window(tiny_models, arch, overrides):
    """Prompts and decodes longer than the window: each windowed layer sees only its last
    `sliding_window` positions, as transformers' masks do, through the paged cache."""
    path = tiny_models(arch, **overrides)
    hf = load_hf(path)
    model = load_model(resolve_model(str(path)), 256, ReferenceAttentionBackend(), torch.float32, CPU)
    windows = [spec.sliding_window for spec in model.kv_cache_spec()]
    assert windows == ([7, 7] if arch == "mistral" else [None, 5])
    prompt = random_prompts(1, [30], seed=5)[0]
    paged = PagedSequences(model, block_size=4)
    logits = paged.run([prompt[:13]])[0]
    logits = torch.cat([logits, paged.run([prompt[13:]])[0]])  # a chunk past the window
    torch.testing.assert_close(logits, _hf_logits(hf, prompt), atol=1e-4, rtol=0)
    sequence = list(prompt)
    for _ in range(4):
        sequence.append(int(logits[-1].argmax()))
        logits = paged.run([[sequence[-1]]])[0]
        torch.testing.assert_close(logits[-1], _hf_logits(hf, sequence)[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_dtypes_stay_close_to_float32(tiny_models, dtype):
    path = tiny_models("llama")
    source = resolve_model(str(path))
    full = load_model(source, 256, ReferenceAttentionBackend(), torch.float32, CPU)
    half = load_model(source, 256, ReferenceAttentionBackend(), dtype, CPU)
    assert half.layer_projections(0)["qkv_proj"].dtype == dtype
    prompt = random_prompts(1, [24], seed=5)[0]
    a = PagedSequences(full, 16).run([prompt])[0]
    b = PagedSequences(half, 16).run([prompt])[0].float()
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    assert cosine.min() > 0.99
    # A random tiny model has near-ties, so rounding flips some top-1 choices; most must agree.
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75


def test_unsupported_architecture_names_the_supported_ones(tiny_llama, tmp_path):
    config = json.loads((tiny_llama / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        load_model(resolve_model(str(tmp_path)), 256, ReferenceAttentionBackend(), torch.float32, CPU)


def test_missing_checkpoint_tensor_is_reported(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_llama / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_llama / "config.json").read_text())
    with pytest.raises(ValueError, match="missing 1 tensor"):
        load_model(resolve_model(str(tmp_path)), 256, ReferenceAttentionBackend(), torch.float32, CPU)
