"""The start-up summary: one block, logged once the engine is ready, that says what it runs.

A user's first question after a start is what was set up, and the answers used to lie in a
dozen lines spread over the start (or nowhere: threads, dtype, `max_model_len` and the kernels'
instruction set were never said). The block names the model and its architecture, how it
computes (dtype, device, threads, the CPU kernels' instruction-set path, the attention backend),
the weights' form and the memory they take once read, the KV cache (blocks x tokens per block,
bytes, swap blocks) with `max_model_len`, the preemption mode, and where the process's memory
went (`MemoryBudget`). The driver worker describes itself (`Worker.describe`, plain data); this
module only words it. Example (the default model, warm start, 2 cores):

    Engine ready: SmolLM2-135M-Instruct (LlamaForCausalLM) from .../SmolLM2-135M-Instruct.Q4_1.gguf
      compute: float32 on cpu, 2 threads, CPU kernels AVX2 (FMA, VPMADDUBSW), attention cpu
      weights: GGUF Q4_1 69%, Q8_0 31%; 92.4 MiB
      KV cache: 2912 blocks x 16 tokens = 46592 tokens, 2.00 GiB float32; 2912 swap blocks; max_model_len 8192
      preemption: auto (swap 0.512 ms a block, recompute 4.15 ms a token)
      Memory: weights 92.4 MiB (9.1 MiB of it resident), KV cache 2.00 GiB (of 2.00 GiB reserved), ...
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.transformers_utils import ModelSource

logger = logging.getLogger("pagedllm")


def format_bytes(n: int) -> str:
    """GiB from 1 GiB up, else MiB (as `model.memory` words them)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def startup_summary(engine: "LLMEngine", source: "ModelSource") -> str:
    """The block `log_startup_summary` logs (see the module's docstring)."""
    config = engine.config
    worker = getattr(engine.executor, "worker", None)  # the driver's, in this process
    facts = worker.describe() if worker is not None else None
    bm = engine.block_manager
    block_size = config.cache.block_size
    lines = [f"Engine ready: {engine.model_name} ({engine.arch.architecture}) from {source.path}"]
    if facts is not None:
        tp = config.parallel.tensor_parallel_size
        per_rank = " per rank" if tp > 1 else ""
        lines.append(
            f"compute: {facts['dtype']} on {facts['device']}, {facts['threads']} threads"
            f"{f' per rank, {tp} tensor-parallel ranks' if tp > 1 else ''}, CPU kernels {facts['kernels']}, "
            f"attention {facts['attention']}"
        )
        lines.append(f"weights: {facts['weight_forms']}; {format_bytes(facts['weight_bytes'])}{per_rank}")
    kv_bytes = bm.num_total_blocks * getattr(engine.executor, "block_bytes", 0)
    lines.append(
        f"KV cache: {bm.num_total_blocks} blocks x {block_size} tokens = {bm.num_total_blocks * block_size} tokens, "
        f"{format_bytes(kv_bytes)}{' ' + facts['cache_dtype'] if facts else ''}; {bm.num_cpu_blocks} swap blocks; "
        f"max_model_len {engine.max_model_len}"
    )
    sched = engine.scheduler.config
    costs = ""
    if sched.preemption_mode == "auto" and bm.num_cpu_blocks and sched.kv_policy == "paged":
        costs = (f" (swap {sched.swap_cost_per_block * 1e3:.3g} ms a block, "
                 f"recompute {sched.recompute_cost_per_token * 1e3:.3g} ms a token)")
    lines.append(f"preemption: {sched.preemption_mode}{costs}")
    if facts is not None:
        lines.append(facts["memory"])
    return "\n  ".join(lines)


def log_startup_summary(engine: "LLMEngine", source: "ModelSource") -> None:
    """Log the summary; a failure to describe never fails a start."""
    try:
        logger.info("%s", startup_summary(engine, source))
    except Exception as exc:  # a stand-in executor or worker without some part: say what is missing
        logger.warning("Could not write the start-up summary (%s: %s)", type(exc).__name__, exc)
