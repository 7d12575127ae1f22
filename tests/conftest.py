"""Shared fixtures: tiny random models (built with transformers, saved as safetensors) and the
embedded default model, each loaded once per test session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Every engine step in the tests (servers they start included) checks the KV cache manager's
# invariants: a leaked or double-counted block fails the test that caused it.
os.environ.setdefault("PAGEDLLM_CHECK_INVARIANTS", "1")

import torch  # noqa: E402

# Without a GPU the Triton kernels run in Triton's interpreter. Triton reads the variable once,
# when it is imported, and transformers imports it with the tiny models, so it is set here,
# before anything can. It changes nothing but Triton, which nothing else uses on a CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.helpers import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """The default model's tokenizer, saved as a Hugging Face folder (tiny models reuse it).
    PAGEDLLM_TEST_TOKENIZER_DIR names another folder with a 49152-token tokenizer instead: the
    GPU check sets it where the default model's package cannot be installed."""
    from pathlib import Path

    from pagedllm.transformers_utils import get_tokenizer, resolve_model

    if os.environ.get("PAGEDLLM_TEST_TOKENIZER_DIR"):
        return Path(os.environ["PAGEDLLM_TEST_TOKENIZER_DIR"])

    tokenizer = get_tokenizer(resolve_model(None))
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer_dir):
    """arch name -> folder of a tiny random model (config.json, model.safetensors, tokenizer)."""
    cache: dict[str, object] = {}

    def get(arch: str = "llama", **overrides):
        key = arch + repr(sorted(overrides.items()))
        if key not in cache:
            cache[key] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, tokenizer_dir, **overrides)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny_llama(tiny_models):
    return tiny_models("llama")


@pytest.fixture(scope="session")
def smollm_hf():
    """transformers' own load of the embedded GGUF: the oracle for the default model."""
    from transformers import AutoModelForCausalLM

    from pagedllm.transformers_utils import resolve_model

    source = resolve_model(None)
    return AutoModelForCausalLM.from_pretrained(str(source.folder), gguf_file=source.path.name).eval()


@pytest.fixture(scope="session")
def smollm_llm():
    """The default model's engine on float32 activations (`int8_activations="off"`, not the
    default "auto" of a GGUF model): the mode whose greedy output is transformers', which the
    tests that share this engine compare with or rely on."""
    from pagedllm import LLM

    return LLM(kv_cache_memory=256 << 20, max_model_len=2048, int8_activations="off")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def triton_device(request):
    """The device a Triton test runs on: the CPU, in Triton's interpreter, and a GPU, compiled
    (marked `gpu`; skipped, with the reason, where there is none)."""
    from pagedllm.kernels.triton_attention import INTERPRETED

    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device: this one checks the compiled kernels")
        if INTERPRETED:
            pytest.skip("TRITON_INTERPRET=1 is set, so Triton interprets even on the GPU; run without it")
    elif not INTERPRETED:
        pytest.skip("Triton compiles for the GPU in this process; CPU tensors need TRITON_INTERPRET=1 before it loads")
    return torch.device(request.param)
