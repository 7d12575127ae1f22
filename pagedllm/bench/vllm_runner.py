"""Runs the throughput benchmark's requests through vLLM's offline `LLM`, inside vLLM's own
virtual environment (see `vllm_peer`). It imports nothing from pagedllm, which is not installed
there.

Usage: python vllm_runner.py REQUEST.json RESULT.json

REQUEST.json: {"model": folder, "dtype": "bfloat16", "max_model_len": int, "seed": int,
               "temperature": float, "requests": [[prompt token ids, output length], ...]}
RESULT.json:  {"elapsed_s", "output_tokens", "load_s", "vllm_version", "torch",
               "torch_cpu_capability", "device"}
Every request generates exactly its output length (`ignore_eos`), as in pagedllm's run.
"""

from __future__ import annotations

import json
import sys
import time


def main(request_path: str, result_path: str) -> int:
    with open(request_path) as f:
        spec = json.load(f)
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        tokenizer=spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        seed=spec["seed"],
        skip_tokenizer_init=False,
    )
    load_s = time.perf_counter() - start
    prompts = [{"prompt_token_ids": ids} for ids, _ in spec["requests"]]
    params = [
        SamplingParams(temperature=spec["temperature"], max_tokens=n, ignore_eos=True, detokenize=False)
        for _, n in spec["requests"]
    ]
    llm.generate(prompts[:1], [SamplingParams(max_tokens=4, ignore_eos=True)], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    result = {
        "elapsed_s": elapsed,
        "output_tokens": sum(len(c.token_ids) for o in outputs for c in o.outputs),
        "load_s": load_s,
        "vllm_version": vllm.__version__,
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
