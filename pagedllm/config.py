"""Engine configuration: plain dataclasses, named like vLLM's engine arguments.

`EngineArgs` is the flat form users write (`LLM(model=..., block_size=16, ...)`, CLI flags);
`EngineArgs.create_engine_config()` checks it and splits it into the per-layer configs.
Imports nothing from the package and nothing heavy.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

from pagedllm.field_types import check_field_types, json_object
from pagedllm.pooling_params import PoolerConfig

logger = logging.getLogger("pagedllm")

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GiB = 1 << 30

PREEMPTION_MODES = ("recompute", "swap", "auto")
# How sequences get KV memory: "paged" is the engine itself (blocks on demand); the others are
# the paper's baselines, contiguous reservations per sequence (pagedllm.core.reservation).
KV_POLICIES = ("paged", "orca-oracle", "orca-pow2", "orca-max", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's other names for the same dtypes.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# vLLM's names of engine arguments that pagedllm names otherwise (vLLM's name -> ours).
ARG_ALIASES = {"kv_cache_memory_bytes": "kv_cache_memory", "num_gpu_blocks_override": "num_gpu_blocks",
               "override_pooler_config": "pooler_config"}
# vLLM engine arguments that change nothing here, and why; accepted with one log line each.
INERT_ARGS = {
    "trust_remote_code": "pagedllm runs its own model code, never a model folder's",
    "enable_chunked_prefill": "pagedllm always chunks long prompts to the step's token budget",
    "tokenizer_mode": "the tokenizer is always the model folder's (fast) one",
    "load_format": "the weights' format is found from the files",
    "download_dir": "models are never downloaded",
    "revision": "models are never downloaded",
    "disable_log_requests": "requests are not logged",
    "disable_custom_all_reduce": "all-reduce is torch.distributed's",
}
# ChatML: the template a GGUF file without one gets, as llama.cpp falls back to it (and the one
# `--chat-template chatml` names).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# `generation_config`: "auto" reads the model folder's generation_config.json, "vllm" ignores
# it, anything else is a folder holding one.
GENERATION_CONFIG_CHOICES = ("auto", "vllm")
# "auto": triton on a GPU, the fast CPU kernel on a CPU (pagedllm.attention.get_attention_backend).
ATTENTION_BACKENDS = ("auto", "reference", "cpu", "triton")
# Modes of GGUF-quantized projections on int8 activations (pagedllm.model.layers.use_int8_activations).
# Not choosing one (None) takes the engine's default: "auto" for a model whose GGUF-quantized
# blocks the CPU kernels serve, "off" otherwise and in batch-invariant mode
# (pagedllm.model.layers.resolve_int8_activations, the one place that decides).
INT8_MODES = ("off", "auto", "on")


@dataclass
class ModelConfig:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"  # "auto": float32 on CPU, bfloat16 on GPU
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    device: str = "auto"  # "auto", "cpu" or "cuda"
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS
    # A sequence's logits do not depend on what else is in the batch, how its prompt was chunked,
    # whether its prefix was cached or it was preempted (see pagedllm.model.invariance and README).
    batch_invariant: bool = False
    # On a GPU, decode steps replay CUDA graphs (pagedllm.worker.cuda_graphs); True runs every
    # step eagerly.
    enforce_eager: bool = False
    # On a CPU, compute with fewer threads while other processes keep cores busy
    # (pagedllm.worker.cpu_threads).
    adapt_cpu_threads: bool = True
    # GGUF-quantized projections multiply int8-quantized activations (llama.cpp's numerics):
    # "off" (float32 activations: greedy output identical to transformers'), "auto" (at the row
    # counts where a measured trial finds int8 faster) or "on"; None: not chosen, the default
    # (INT8_MODES says which).
    int8_activations: str | None = None
    # On a CPU, the threads a worker computes with (None: torch's default, OMP_NUM_THREADS or
    # one per core; llama-server's -t). The thread governor never goes above it.
    threads: int | None = None


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for all layers' key and value pools; None: a default
    # On a GPU without kv_cache_memory: the fraction of the device's memory this engine may use
    # (weights, the peak activations of a forward pass at max_num_batched_tokens, the KV cache).
    gpu_memory_utilization: float = 0.9
    num_device_blocks: int | None = None  # force the number of device blocks (overrides the budget)
    swap_space: float = 4.0  # GiB of CPU memory for swapped-out blocks, per worker
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "bfloat16" halves a float32 model's cache
    # Share KV blocks between the sequences of one request (parallel samples, beams), with
    # copy-on-write. Turning it off (every sequence gets its own copy) exists to measure it.
    enable_block_sharing: bool = True


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    preemption_mode: str = "auto"
    # Fraction of device blocks kept free when admitting new prompts, so that a newly admitted
    # prompt does not immediately force a preemption on the next decode step.
    watermark: float = 0.01
    # The `auto` preemption mode's cost model, in seconds, measured by the engine at start-up:
    # a single-sequence victim is swapped when
    # blocks * swap_cost_per_block < tokens * recompute_cost_per_token.
    swap_cost_per_block: float = 1.0
    recompute_cost_per_token: float = 1.0
    kv_policy: str = "paged"  # one of KV_POLICIES
    # The time budget of one step, in seconds (None: no budget): prompt chunks are sized from
    # the measured cost per token so that a long prompt never stretches a step beyond it, and
    # every other stream keeps its pace (pagedllm.engine.step_budget).
    max_step_seconds: float | None = None


@dataclass
class RequestLimits:
    """What one request may ask for: above these, `add_request` refuses it with an error naming
    the limit (a 400 from the server), so that no single request holds the others hostage."""

    max_n: int = 16  # n and best_of (parallel samples)
    max_beam_width: int = 16  # best_of with use_beam_search
    # The most sequences one server request may start (prompts x best_of or beam width): a
    # request of thousands of prompts would otherwise take every slot before later requests.
    max_seqs_per_request: int = 256
    # The compiled-grammar cache's byte budget; a grammar larger than it alone is refused.
    structured_outputs_cache_bytes: int = 256 << 20
    # The longest a grammar may take to compile before its request is refused.
    structured_outputs_compile_seconds: float = 30.0


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_init_method: str | None = None  # e.g. "env://" under torchrun


SPECULATIVE_METHODS = ("ngram", "draft_model")
_SPECULATIVE_KEYS = {
    "method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model", "adaptive",
}


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): each step proposes up to
    `num_speculative_tokens` tokens per decoding sequence and the target model verifies them all
    in one pass (docs/speculative-decoding.md).

    method "ngram": the proposal continues the latest earlier occurrence, in the sequence's own
    prompt and output, of its last n tokens (n from `prompt_lookup_max` down to
    `prompt_lookup_min`). method "draft_model": a smaller model (`model`, sharing the target's
    vocabulary) proposes greedily. `adaptive` (ours): each step the engine picks, per sequence,
    how many of the proposed tokens to verify (down to none) from the sequence's measured
    acceptance rate and the measured cost of a step; False verifies every proposed token."""

    method: str = "ngram"
    num_speculative_tokens: int = 8
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    adaptive: bool = True

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From vLLM's dict, its JSON text (`--speculative-config`), or None (no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        unknown = sorted(set(value) - _SPECULATIVE_KEYS)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; known: {sorted(_SPECULATIVE_KEYS)}.")
        if "method" not in value:
            value = {**value, "method": "draft_model" if value.get("model") else "ngram"}
        config = cls(**value)
        config.verify()
        return config

    def verify(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPECULATIVE_METHODS}, got {self.method!r}.")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}.")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                f"({self.prompt_lookup_max})."
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative_config.model is required for method "draft_model" (the draft model\'s path).')
        if self.method == "ngram" and self.model:
            raise ValueError('speculative_config.model is only for method "draft_model"; drop it for "ngram".')


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    disable_log_stats: bool = False
    limits: RequestLimits = dataclasses.field(default_factory=RequestLimits)
    speculative: SpeculativeConfig | None = None
    pooler: PoolerConfig = dataclasses.field(default_factory=PoolerConfig)  # pooling requests' defaults


@dataclass
class EngineArgs:
    """Every engine argument in one flat dataclass (the names of vLLM's `EngineArgs`)."""

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    device: str = "auto"
    attention_backend: str = "auto"
    batch_invariant: bool = False
    enforce_eager: bool = False
    adapt_cpu_threads: bool = True
    int8_activations: str | None = None  # None: the default (INT8_MODES)
    threads: int | None = None  # None: torch's default
    block_size: int = 16
    kv_cache_memory: int | None = None
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    swap_space: float = 4.0
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    enable_block_sharing: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    preemption_mode: str = "auto"
    kv_policy: str = "paged"
    max_step_seconds: float | None = 0.5
    max_n: int = 16
    max_beam_width: int = 16
    max_seqs_per_request: int = 256
    structured_outputs_cache_bytes: int = 256 << 20
    structured_outputs_compile_seconds: float = 30.0
    tensor_parallel_size: int = 1
    distributed_init_method: str | None = None
    disable_log_stats: bool = False
    # Speculative decoding: vLLM's dict ({"method": "ngram", "num_speculative_tokens": k, ...}),
    # its JSON text, or None (SpeculativeConfig).
    speculative_config: dict | str | None = None
    # Default sampling from a generation_config.json (used by the entry points, not the engine).
    generation_config: str = "auto"
    # The defaults of pooling (embedding) requests: vLLM's PoolerConfig, a dict or its JSON text
    # ({"pooling_type": "MEAN", "normalize": false}); None: the last token, normalized.
    pooler_config: dict | str | PoolerConfig | None = None

    def __post_init__(self) -> None:
        for name in ("model", "tokenizer"):  # a path object names a folder as well as its text
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        check_field_types(self)
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        self.kv_cache_dtype = DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        """From keyword arguments, vLLM's names included (`kv_cache_memory_bytes`,
        `num_gpu_blocks_override`; `trust_remote_code` and others that change nothing here are
        accepted with a log line)."""
        for name, why in INERT_ARGS.items():
            if name in kwargs:
                value = kwargs.pop(name)
                logger.info("%s=%r changes nothing: %s.", name, value, why)
        for vllm_name, name in ARG_ALIASES.items():
            if vllm_name in kwargs:
                if name in kwargs:
                    raise TypeError(f"Give {vllm_name} or {name}, not both: they are the same argument.")
                kwargs[name] = kwargs.pop(vllm_name)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(
                f"Unknown engine argument(s) {unknown}. Valid arguments: {', '.join(sorted(names))}."
            )
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        self._verify()
        speculative = SpeculativeConfig.parse(self.speculative_config)
        pooler = PoolerConfig.parse(self.pooler_config)
        if speculative is not None and self.batch_invariant:
            raise ValueError(
                "speculative_config and batch_invariant do not combine: verifying proposed tokens computes a "
                "sequence's positions several at a time, which batch-invariant mode's fixed decode path does not; "
                "turn one of them off."
            )
        if speculative is not None and self.kv_policy != "paged":
            raise ValueError(
                f"speculative_config needs kv_policy='paged' (got {self.kv_policy!r}): the paper's reservation "
                "baselines cannot roll back rejected tokens' slots."
            )
        max_num_batched_tokens = self.max_num_batched_tokens or max(2048, self.max_num_seqs)
        return EngineConfig(
            model=ModelConfig(
                model=self.model,
                tokenizer=self.tokenizer,
                dtype=self.dtype,
                max_model_len=self.max_model_len,
                seed=self.seed,
                device=self.device,
                attention_backend=self.attention_backend,
                batch_invariant=self.batch_invariant,
                enforce_eager=self.enforce_eager,
                adapt_cpu_threads=self.adapt_cpu_threads,
                int8_activations=self.int8_activations,
                threads=self.threads,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory=self.kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_device_blocks=self.num_gpu_blocks,  # vLLM's name for the flag
                swap_space=self.swap_space,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_dtype=self.kv_cache_dtype,
                enable_block_sharing=self.enable_block_sharing,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                preemption_mode=self.preemption_mode,
                kv_policy=self.kv_policy,
                max_step_seconds=self.max_step_seconds or None,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                distributed_init_method=self.distributed_init_method,
            ),
            disable_log_stats=self.disable_log_stats,
            limits=RequestLimits(
                max_n=self.max_n,
                max_beam_width=self.max_beam_width,
                max_seqs_per_request=self.max_seqs_per_request,
                structured_outputs_cache_bytes=self.structured_outputs_cache_bytes,
                structured_outputs_compile_seconds=self.structured_outputs_compile_seconds,
            ),
            speculative=speculative,
            pooler=pooler,
        )

    def _verify(self) -> None:
        check_field_types(self)  # fields may have been set after construction

        def positive_int(name: str, value: object) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")

        positive_int("block_size", self.block_size)
        positive_int("max_num_seqs", self.max_num_seqs)
        positive_int("tensor_parallel_size", self.tensor_parallel_size)
        positive_int("max_n", self.max_n)
        positive_int("max_beam_width", self.max_beam_width)
        positive_int("structured_outputs_cache_bytes", self.structured_outputs_cache_bytes)
        if self.max_step_seconds is not None and not self.max_step_seconds >= 0:
            raise ValueError(f"max_step_seconds must be >= 0 (0 or None: no budget), got {self.max_step_seconds!r}.")
        if not self.structured_outputs_compile_seconds > 0:
            raise ValueError(
                f"structured_outputs_compile_seconds must be a positive number of seconds, got "
                f"{self.structured_outputs_compile_seconds!r}."
            )
        for name in ("max_model_len", "num_gpu_blocks", "kv_cache_memory", "max_num_batched_tokens", "threads",
                     "max_seqs_per_request"):
            value = getattr(self, name)
            if value is not None:
                positive_int(name, value)
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}), so that every running sequence can decode in one step."
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES} (or {tuple(DTYPE_ALIASES)}), got {self.dtype!r}.")
        if self.kv_cache_dtype not in DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {DTYPES}, got {self.kv_cache_dtype!r}.")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}.")
        if self.kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy must be one of {KV_POLICIES}, got {self.kv_policy!r}.")
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}.")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 (GiB), got {self.swap_space!r}.")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}.")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}.")
        if self.int8_activations is not None and self.int8_activations not in INT8_MODES:
            raise ValueError(
                f"int8_activations must be one of {INT8_MODES} (or None for the default), got {self.int8_activations!r}."
            )
        if self.int8_activations in ("auto", "on") and self.batch_invariant:
            raise ValueError(
                f"int8_activations={self.int8_activations!r} (--int8-activations {self.int8_activations}) and "
                "batch_invariant do not combine: batch-invariant mode keeps every product in float32 at a fixed row "
                "tile. Drop int8_activations (batch-invariant mode defaults it to 'off') or batch_invariant."
            )
