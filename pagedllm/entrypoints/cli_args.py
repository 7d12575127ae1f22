"""Engine arguments as command-line flags, named like vLLM's (`--block-size`, `--max-num-seqs`, ...),
with llama-server's names for the same (`-c`, `-np`, `-t`, `-m`); the flags of both that mean
nothing here or are not built are in `launch_flags`."""

from __future__ import annotations

import argparse
import dataclasses
import logging

from pagedllm.config import (
    ARG_ALIASES,
    ATTENTION_BACKENDS,
    DEFAULT_MODEL,
    DTYPE_ALIASES,
    DTYPES,
    INERT_ARGS,
    INT8_MODES,
    KV_POLICIES,
    PREEMPTION_MODES,
    EngineArgs,
)
from pagedllm.entrypoints.launch_flags import add_launch_flags, apply_launch_flags, parse_context, parse_count

logger = logging.getLogger("pagedllm")

_HELP = {
    "tokenizer": "tokenizer folder (default: the model's own)",
    "dtype": "weights and activations; auto = float32 on CPU, bfloat16 on GPU",
    "max_model_len": "context length (default: the model's)",
    "seed": "seed of the engine's random state (requests may carry their own seed)",
    "device": "auto, cpu or cuda",
    "attention_backend": "auto (triton on a GPU, cpu on a CPU), reference (the plain torch oracle), cpu or triton",
    "batch_invariant": "a request's tokens never depend on the rest of the batch, chunking, prefix caching or "
    "preemption: seeded sampling and greedy decoding reproduce under any load (float32 on a CPU)",
    "enforce_eager": "on a GPU, run every step eagerly: no CUDA graphs of decode steps",
    "adapt_cpu_threads": "on a CPU, compute with fewer threads while other processes keep cores busy",
    "int8_activations": "GGUF-quantized projections multiply int8-quantized activations, as llama.cpp does (VNNI, "
    "AMX or AVX2 integer dot products): auto (where a trial measured once per machine finds it faster), on, or off "
    "(float32 activations: greedy output identical to transformers'). Default: auto for a GGUF-quantized model on "
    "a CPU, off otherwise and with --batch-invariant",
    "block_size": "tokens per KV block",
    "kv_cache_memory": "bytes of KV cache (keys and values, all layers); default: 2 GiB on CPU",
    "gpu_memory_utilization": "on a GPU, the fraction of its memory the engine may use (weights, activations, KV cache)",
    "num_gpu_blocks": "force the number of KV blocks (overrides --kv-cache-memory)",
    "swap_space": "GiB of CPU memory for swapped-out blocks",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "kv_cache_dtype": "dtype of the KV cache; auto = the model's (bfloat16 halves a float32 model's cache)",
    "enable_block_sharing": "share KV blocks between a request's samples and beams (off only to measure it)",
    "max_num_seqs": "most sequences running at once",
    "max_num_batched_tokens": "most tokens computed in one step",
    "preemption_mode": "how to evict when blocks run out",
    "kv_policy": "KV memory: paged (this engine), or a baseline of the paper reserving contiguous memory per sequence",
    "max_step_seconds": "time budget of one engine step: prompt chunks are sized from the measured cost per token so "
    "that a long prompt never stalls the other streams longer (0: no budget, chunks of --max-num-batched-tokens)",
    "max_n": "most parallel samples (n, best_of) one request may ask for; above it the request is refused",
    "max_seqs_per_request": "most sequences one server request may start (its prompts x n, best_of or beam width); "
    "above it the request is refused, so that one request cannot take every slot before the others",
    "max_beam_width": "widest beam search one request may ask for; above it the request is refused",
    "structured_outputs_cache_bytes": "byte budget of the compiled-grammar cache (least recently used dropped "
    "first); a grammar larger than it alone is refused",
    "structured_outputs_compile_seconds": "longest a request's grammar may take to compile before the request is refused",
    "tensor_parallel_size": "number of tensor-parallel workers",
    "distributed_init_method": "torch.distributed init method (env:// under torchrun)",
    "disable_log_stats": "do not log periodic engine stats",
    "speculative_config": "speculative decoding, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 8, "
    "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2} or {\"method\": \"draft_model\", \"model\": PATH, ...} "
    "(docs/speculative-decoding.md)",
    "threads": "on a CPU, threads to compute with (default: OMP_NUM_THREADS, else one per core)",
    "pooler_config": "the pooling of embedding requests (/v1/embeddings, /pooling, LLM.embed), as JSON: "
    "{\"pooling_type\": \"LAST\" | \"MEAN\" | \"CLS\", \"normalize\": true} (the default: LAST, normalized)",
    "generation_config": "default sampling: auto = the model folder's generation_config.json (temperature, top_p, "
    "top_k, repetition_penalty, max_new_tokens), vllm = none, or a folder holding one",
}
# Flags of engine arguments that take no value in vLLM (the rest of INERT_ARGS take one).
_INERT_SWITCHES = ("trust_remote_code", "disable_log_requests", "disable_custom_all_reduce")
_DTYPE_CHOICES = DTYPES + tuple(DTYPE_ALIASES)
# kv_cache_dtype has no choices: a value such as fp8 gets its own message (launch_flags).
_CHOICES = {"attention_backend": ATTENTION_BACKENDS, "dtype": _DTYPE_CHOICES, "preemption_mode": PREEMPTION_MODES, "kv_policy": KV_POLICIES, "device": ("auto", "cpu", "cuda"), "int8_activations": INT8_MODES}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5G', or a plain number of bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    if value and value[-1] in units:
        return int(float(value[:-1]) * units[value[-1]])
    return int(value)


# llama-server's flags (and vLLM's short ones) for our engine arguments.
_SHORT_ALIASES = {
    "max_model_len": ["-c", "--ctx-size"],
    "max_num_seqs": ["-np", "--parallel"],
    "threads": ["-t"],
    "max_num_batched_tokens": ["-b", "--batch-size"],
    "seed": ["-s"],
}
# Counts written as vLLM reads them (4k, 4K); llama-server's -c takes 0 for the model's own.
_TYPES = {"max_model_len": parse_context, "max_num_batched_tokens": parse_count,
          "kv_cache_memory": parse_bytes, "structured_outputs_cache_bytes": parse_bytes}


def add_engine_args(parser: argparse.ArgumentParser, with_model: bool = True, launch: str | None = None) -> None:
    """The engine's flags on `parser`. Every command takes the model as `--model`/`-m`; those
    whose positional arguments are not prompts take it as their first one too (`serve MODEL`).
    `launch` ("serve" or "cli": generate, chat, demo) adds llama-server's short names and the
    flags of both engines that mean nothing here or are not built (benchmarks have flags of
    their own, such as `--batch-size`)."""
    group = parser.add_argument_group("engine")
    if with_model:
        parser.add_argument("model", nargs="?", default=None, help=f"model name or path (default: {DEFAULT_MODEL})")
    group.add_argument("--model", "-m", dest="model_flag", default=None, metavar="MODEL",
                       help="the model, as vLLM's --model and llama-server's -m (a GGUF file or a model folder)")
    for field in dataclasses.fields(EngineArgs):
        if field.name in ("model", "extra"):
            continue
        flag = "--" + field.name.replace("_", "-")
        kwargs = {"default": field.default, "help": _HELP.get(field.name)}
        if field.type in ("bool", bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kind = {"int | None": int, "int": int, "float": float, "str": str, "str | None": str, "float | None": float}.get(
                str(field.type), str
            )
            kwargs["type"] = _TYPES.get(field.name, kind)
            if field.name in _CHOICES:
                kwargs["choices"] = _CHOICES[field.name]
        if field.name == "gpu_memory_utilization" and launch is not None:
            kwargs["default"] = None  # to tell whether it was given: on a CPU it means nothing (one warning)
        names = [flag, *_flag_aliases(field.name, short=launch is not None)]
        group.add_argument(*names, dest=field.name, **kwargs)
    _add_inert_args(parser)
    if launch is not None:
        add_launch_flags(parser, serve=launch == "serve")


def _flag_aliases(name: str, short: bool) -> list[str]:
    """vLLM's and llama-server's other flags for an engine argument (`--kv-cache-memory-bytes`,
    `-tp`; with `short`, `-c`, `-np`, `-t`...)."""
    aliases = ["--" + vllm.replace("_", "-") for vllm, ours in ARG_ALIASES.items() if ours == name]
    if name == "tensor_parallel_size":
        aliases.append("-tp")
    return aliases + (_SHORT_ALIASES.get(name, []) if short else [])


def _add_inert_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("accepted for vLLM compatibility (they change nothing here)")
    for name, why in INERT_ARGS.items():
        flag = "--" + name.replace("_", "-")
        if name in _INERT_SWITCHES:
            group.add_argument(flag, dest=name, action="store_true", default=None, help=why)
        elif name == "enable_chunked_prefill":
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=why)
        else:
            group.add_argument(flag, dest=name, default=None, help=why)


def log_inert_args(ns: argparse.Namespace) -> None:
    """One warning for each flag given that changes nothing here."""
    for name, why in INERT_ARGS.items():
        value = getattr(ns, name, None)
        if value is not None:
            logger.warning("Ignoring --%s%s: %s.", name.replace("_", "-"), "" if value is True else f" {value}", why)


def prepare_engine_namespace(ns: argparse.Namespace) -> None:
    """Settle what the command line asked of the engine, once, before anything is built: the
    model (positional or `--model`/`-m`), vLLM's and llama-server's flags folded into ours
    (`launch_flags`), a ValueError for a value not served here, one warning per ignored flag."""
    if getattr(ns, "engine_namespace_prepared", False):
        return
    ns.engine_namespace_prepared = True
    positional, flag = getattr(ns, "model", None), getattr(ns, "model_flag", None)
    if positional and flag and positional != flag:
        raise ValueError(f"Two models given: {positional!r} and --model {flag!r}; give one.")
    ns.model = positional or flag or DEFAULT_MODEL
    log_inert_args(ns)
    apply_launch_flags(ns)
    kv_dtype = ns.kv_cache_dtype
    if kv_dtype not in _DTYPE_CHOICES:
        raise ValueError(
            f"--kv-cache-dtype {kv_dtype} is not supported here: the KV cache holds {', '.join(DTYPES[1:])} "
            "(auto: the model's dtype); an 8-bit cache is not built yet. Give bfloat16 to halve a float32 cache."
        )
    if ns.gpu_memory_utilization is not None and not _has_gpu(ns.device):
        logger.warning("Ignoring --gpu-memory-utilization %s: on a CPU the KV cache is sized by --kv-cache-memory.",
                       ns.gpu_memory_utilization)


def _has_gpu(device: str) -> bool:
    if device != "auto":
        return device == "cuda"
    import torch

    return torch.cuda.is_available()


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    prepare_engine_namespace(ns)
    names = {f.name for f in dataclasses.fields(EngineArgs)} - {"extra"}
    # A flag left out whose default is None (gpu_memory_utilization's here) takes EngineArgs' own.
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in names and v is not None})


def add_chat_template_arg(parser: argparse.ArgumentParser, optional: bool = False) -> None:
    """`--chat-template`, alike in generate, chat and serve: a Jinja template, a file holding one,
    or a named one (chatml), replacing the model's own. With `optional` (generate), the flag alone
    wraps each prompt in the model's own template."""
    about = "a Jinja chat template, a file holding one, or chatml, used instead of the model's own"
    if optional:
        parser.add_argument("--chat-template", nargs="?", const="", default=None, metavar="TEMPLATE",
                            help="wrap each prompt in the chat template: the model's own, or " + about)
    else:
        parser.add_argument("--chat-template", default=None, metavar="TEMPLATE", help=about)
    parser.add_argument("--chat-template-file", dest="chat_template", default=None, metavar="FILE",
                        help="llama-server's flag: a file holding the chat template")


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--sampling-seed", type=int, default=None, help="seed of the request's own random stream")


def sampling_params_from(ns: argparse.Namespace):
    from pagedllm.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        min_p=ns.min_p,
        seed=ns.sampling_seed,
    )
