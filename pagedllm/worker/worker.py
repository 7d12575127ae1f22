"""A worker: one model replica (or one tensor-parallel shard of it), its KV cache and its step."""

from __future__ import annotations

import logging
import time

import torch

from pagedllm.attention import get_attention_backend
from pagedllm.config import GiB, EngineConfig
from pagedllm.core.model_output import ModelRunnerOutput
from pagedllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedllm.distributed import TensorParallelGroup
from pagedllm.kv_spec import kv_cache_groups, layers_per_group
from pagedllm.model import load_model, resolve_dtype
from pagedllm.model.invariance import make_batch_invariant
from pagedllm.model.fused_layers import enable_fused_layers
from pagedllm.model.layers import resolve_int8_activations, use_int8_activations
from pagedllm.model.describe import kernels_path, weight_forms
from pagedllm.model.memory import MemoryBudget, memory_budget
from pagedllm.sampling import Sampler
from pagedllm.transformers_utils import resolve_model
from pagedllm.utils import cdiv
from pagedllm.worker.cache_engine import CacheEngine, bytes_per_block
from pagedllm.worker.cpu_memory import keep_freed_memory
from pagedllm.worker.cpu_threads import ThreadGovernor
from pagedllm.worker.cuda_graphs import MAX_GRAPH_TOKENS, DecodeGraphs
from pagedllm.worker.host_pool import available_memory
from pagedllm.worker.profile_cache import cached_preemption_costs, machine_identity, model_identity
from pagedllm.worker.model_runner import ModelRunner, build_attention_metadata

logger = logging.getLogger("pagedllm")

# Default KV cache budget on the CPU, before the cap by available memory.
DEFAULT_CPU_KV_CACHE_MEMORY = 2 * GiB
# The most of the available host memory the KV cache may take on a CPU.
CPU_KV_CACHE_MAX_FRACTION = 0.8
# Start-up measurement of the preemption costs: blocks swapped out and in, tokens recomputed.
PROFILE_SWAP_BLOCKS = 16
PROFILE_PREFILL_TOKENS = 256


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but torch sees no CUDA device; use device='cpu'.")
    return torch.device(device)


def profile_batch(num_tokens: int, max_model_len: int, block_size: int, num_groups: int = 1) -> list[ScheduledSequence]:
    """Dummy prompts of `num_tokens` tokens in all (none longer than the context), on distinct
    blocks numbered from 0 (one table per KV cache group): the largest step the scheduler may
    send, for memory profiling."""
    items, first_block = [], 0
    while num_tokens > 0:
        length = min(num_tokens, max_model_len)
        blocks = cdiv(length, block_size)
        tables = [list(range(first_block + g * blocks, first_block + (g + 1) * blocks)) for g in range(num_groups)]
        items.append(ScheduledSequence(
            seq_id=-1 - len(items), request_id="", token_ids=[0] * length, start_position=0,
            block_table=tables[0], sampling_params=None, other_block_tables=tables[1:],
        ))
        first_block += num_groups * blocks
        num_tokens -= length
    return items


def gpu_kv_cache_budget(total: int, utilization: float, peak: int, non_torch: int) -> int:
    """Bytes left for the KV cache: `utilization` of the device's `total` memory, less the peak
    of weights and activations measured by a profile run and the memory torch does not manage."""
    budget = int(total * utilization) - peak - non_torch
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} gives this engine {total * utilization / GiB:.2f} GiB of the "
            f"device's {total / GiB:.2f} GiB, but the weights and the peak activations of a forward pass already "
            f"take {(peak + non_torch) / GiB:.2f} GiB, leaving nothing for the KV cache. Raise "
            "gpu_memory_utilization, lower max_num_batched_tokens or max_num_seqs, or use a smaller model or dtype."
        )
    return budget


class Worker:
    def __init__(self, config: EngineConfig, max_model_len: int, tp: TensorParallelGroup = TensorParallelGroup()):
        self.config = config
        self.max_model_len = max_model_len
        self.tp = tp
        self.device = resolve_device(config.model.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(tp.rank % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            keep_freed_memory()  # a step's temporaries reuse the last step's pages (cpu_memory)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        cache_dtype = config.cache.kv_cache_dtype
        self.cache_dtype = self.dtype if cache_dtype == "auto" else resolve_dtype(cache_dtype, self.device)
        invariant = config.model.batch_invariant
        if invariant and (self.device.type != "cpu" or self.dtype != torch.float32):
            raise ValueError(
                f"batch_invariant=True is built for float32 on a CPU, not {self.dtype} on {self.device.type}; "
                "use device='cpu' and dtype='float32', or drop batch_invariant."
            )
        self.backend = get_attention_backend(
            config.model.attention_backend, self.device, self.dtype, self.cache_dtype, batch_invariant=invariant
        )
        torch.manual_seed(config.model.seed)
        source = resolve_model(config.model.model)
        self.model = load_model(source, max_model_len, self.backend, self.dtype, self.device, tp)
        if invariant:
            make_batch_invariant(self.model)
        # The int8-activation mode in force ("off", "auto" or "on"), the default resolved here.
        self.int8_activations = resolve_int8_activations(self.model, config.model.int8_activations, invariant)
        use_int8_activations(self.model, self.int8_activations, by_default=config.model.int8_activations is None)
        enable_fused_layers(self.model, self.backend)
        self.kv_cache_spec = self.model.kv_cache_spec()
        if len({(spec.num_kv_heads, spec.head_dim) for spec in self.kv_cache_spec}) != 1:
            raise ValueError("pagedllm's KV cache pools need every layer to store the same KV heads and head size.")
        self.num_kv_heads = self.kv_cache_spec[0].num_kv_heads
        self.head_dim = self.kv_cache_spec[0].head_dim
        self.num_layers = len(self.kv_cache_spec)
        # Layers grouped by window, one block table each; a block id spans one key and one value
        # tensor per layer of a group (all the layers, for a model whose layers attend alike).
        self.kv_cache_groups = kv_cache_groups(self.kv_cache_spec)
        self.num_kv_tensors = layers_per_group(self.kv_cache_groups)
        self.block_bytes = bytes_per_block(
            self.num_kv_tensors, config.cache.block_size, self.num_kv_heads, self.head_dim, self.cache_dtype
        )
        self.cache_engine: CacheEngine | None = None
        self.runner: ModelRunner | None = None
        if config.model.threads is not None and self.device.type == "cpu":
            torch.set_num_threads(config.model.threads)  # before the governor takes it as its ceiling
        # The threads this worker's thread computes with (OpenMP's count is the calling thread's).
        self.num_threads = torch.get_num_threads()
        # Tensor-parallel ranks would count each other as the machine's other load.
        adapt = config.model.adapt_cpu_threads and not invariant and tp.size == 1
        self.thread_governor = ThreadGovernor() if adapt and self.device.type == "cpu" else None

    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, cpu swap blocks) that the budgets allow."""
        cache = self.config.cache
        if cache.num_device_blocks is not None:
            num_device_blocks = cache.num_device_blocks
        else:
            if cache.kv_cache_memory is not None:
                budget = cache.kv_cache_memory
            elif self.device.type == "cuda":
                budget = self._profile_gpu_kv_budget()
            else:
                budget = DEFAULT_CPU_KV_CACHE_MEMORY
            if self.device.type == "cpu":
                budget = min(budget, int(available_memory() * CPU_KV_CACHE_MAX_FRACTION))
            num_device_blocks = budget // self.block_bytes
        num_cpu_blocks = min(int(cache.swap_space * GiB) // self.block_bytes, num_device_blocks)
        return num_device_blocks, num_cpu_blocks

    def _profile_gpu_kv_budget(self) -> int:
        """vLLM's rule: run a forward pass over `max_num_batched_tokens` dummy tokens (and the
        sampler's largest logits) to find the peak memory that weights and activations take;
        the KV cache gets what is left of `gpu_memory_utilization` of the device."""
        sched = self.config.scheduler
        block_size = self.config.cache.block_size
        items = profile_batch(sched.max_num_batched_tokens, self.max_model_len, block_size, len(self.kv_cache_groups))
        num_blocks = sum(len(table) for item in items for table in item.block_tables)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)  # CUDA context, libraries
        scratch = CacheEngine(self.backend, self.num_kv_tensors, self.num_kv_heads, self.head_dim, block_size,
                              num_blocks, 0, self.cache_dtype, self.device)
        self._bind_kv_cache(scratch)
        with torch.inference_mode():
            input_ids, positions, metadata = build_attention_metadata(items, block_size, self.device)
            hidden = self.model(input_ids, positions, metadata)
            rows = hidden[-1:].expand(min(sched.max_num_seqs, sched.max_num_batched_tokens), -1)
            logits = self.model.compute_logits(rows)
            if logits is not None:  # the sampler's largest temporaries: a sort and a cumulative sum
                logits.float().sort(dim=-1)[0].softmax(dim=-1).cumsum(dim=-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - num_blocks * self.block_bytes
        del scratch, hidden, logits, rows
        torch.cuda.empty_cache()
        budget = gpu_kv_cache_budget(total, self.config.cache.gpu_memory_utilization, peak, non_torch)
        logger.info(
            "GPU memory: %.2f GiB total, x %.2f = %.2f GiB for this engine: weights and peak activations "
            "(%d tokens) %.2f GiB, outside torch %.2f GiB, KV cache %.2f GiB",
            total / GiB, self.config.cache.gpu_memory_utilization, total * self.config.cache.gpu_memory_utilization / GiB,
            sched.max_num_batched_tokens, peak / GiB, non_torch / GiB, budget / GiB,
        )
        return budget

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        self.cache_engine = CacheEngine(
            self.backend,
            self.num_kv_tensors,
            self.num_kv_heads,
            self.head_dim,
            self.config.cache.block_size,
            num_device_blocks,
            num_cpu_blocks,
            self.cache_dtype,
            self.device,
        )
        self._bind_kv_cache(self.cache_engine)
        sampler = Sampler(self.config.model.seed) if self.tp.is_driver else None
        self.runner = ModelRunner(self.model, self.config.cache.block_size, self.device, sampler, self._decode_graphs(),
                                  len(self.kv_cache_groups))

    def _bind_kv_cache(self, cache: CacheEngine) -> None:
        """Each layer gets the tensors of its place in its KV cache group (the i-th layer of every
        group shares the i-th tensor: a block id belongs to one group at a time)."""
        keys, values, groups = [None] * self.num_layers, [None] * self.num_layers, [0] * self.num_layers
        for g, group in enumerate(self.kv_cache_groups):
            for i, layer in enumerate(group.layers):
                keys[layer], values[layer], groups[layer] = cache.key_caches[i], cache.value_caches[i], g
        self.model.bind_kv_cache(keys, values, groups)

    def _decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs of decode steps (and with speculation, of steps verifying proposed tokens),
        captured now: on a GPU with the Triton backend, unless `enforce_eager`. Tensor-parallel
        workers run eagerly (their all-reduces are not captured)."""
        if self.device.type != "cuda" or self.backend.name != "triton" or self.config.model.enforce_eager:
            return None
        if self.tp.size > 1:
            logger.info("CUDA graphs are off with tensor parallelism: decode steps run eagerly.")
            return None
        if not self.model.supports_cuda_graphs:
            logger.info("CUDA graphs are off for this model (experts, or windowed or soft-capped attention): decode "
                        "steps run eagerly.")
            return None
        speculative = self.config.speculative
        sched = self.config.scheduler
        # A verify step's graph holds at most as many rows as the profiled forward pass.
        graphs = DecodeGraphs(self.model, self.backend, self.config.cache.block_size, self.max_model_len,
                              sched.max_num_seqs, self.device,
                              num_speculative_tokens=speculative.num_speculative_tokens if speculative else None,
                              max_tokens=min(MAX_GRAPH_TOKENS, sched.max_num_batched_tokens))
        graphs.capture()
        return graphs

    def kv_cache_shape(self) -> tuple[int, ...]:
        """The shape of this worker's key (and value) pool of each layer."""
        return tuple(self.cache_engine.key_caches[0].shape)

    def profile_preemption_costs(self) -> tuple[float, float]:
        """(seconds to swap one block out and back in, seconds to recompute one token), measured
        on the real pools and model while nothing lives in the cache, the first time this
        machine runs this model so configured (see `profile_cache`)."""
        cache = self.cache_engine
        block_size = self.config.cache.block_size
        num = min(PROFILE_SWAP_BLOCKS, cache.num_device_blocks, cache.num_cpu_blocks)
        per_group_blocks = cache.num_device_blocks // len(self.kv_cache_groups)
        num_tokens = min(PROFILE_PREFILL_TOKENS, per_group_blocks * block_size, self.max_model_len)
        parts = (
            model_identity(resolve_model(self.config.model.model).path), machine_identity(), self.device.type,
            self.dtype, self.cache_dtype, type(self.backend).__name__, self.kv_cache_shape(), self.tp.size,
            num, num_tokens,
        )
        return cached_preemption_costs(parts, lambda: self._measure_preemption_costs(num, num_tokens))

    def _measure_preemption_costs(self, num_blocks: int, num_tokens: int) -> tuple[float, float]:
        """The faster of two swaps (cheap; a run slowed by a neighbour is not the machine's cost),
        and one prefill after a warm-up one (each costs a forward pass on a cold start)."""
        cache = self.cache_engine
        if cache.host_pools is not None:
            # Not beside the thread still mapping the pools: it takes a core, and two compute
            # threads sharing the other stall at every parallel region (measured: a 256-token
            # prefill 30x slower). This measurement is kept for every later start.
            cache.host_pools.populated.wait(timeout=120)
        swap_cost = float("inf")
        if num_blocks:
            mapping = [(i, i) for i in range(num_blocks)]
            cache.swap_out(mapping)  # warm-up
            times = []
            for _ in range(2):
                start = time.perf_counter()
                cache.swap_out(mapping)
                cache.swap_in(mapping)
                self._synchronize()
                times.append(time.perf_counter() - start)
            swap_cost = min(times) / num_blocks
        recompute_cost = min(self.runner.time_prefill(num_tokens)) / num_tokens
        return swap_cost, recompute_cost

    def memory_budget(self) -> MemoryBudget:
        """What this worker's weights, KV cache and swap pool hold now, and the rest of its
        process (see `pagedllm.model.memory`)."""
        cache = self.cache_engine
        return memory_budget(
            self.model, cache.key_caches + cache.value_caches, cache.cpu_key_caches + cache.cpu_value_caches
        )

    def describe(self) -> dict:
        """This worker in words and numbers, plain data for the engine's start-up summary
        (`engine/startup_summary.py`): how it computes, its weights' forms and bytes, its memory."""
        budget = self.memory_budget()
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "cache_dtype": str(self.cache_dtype).removeprefix("torch."),
            "device": self.device.type,
            "threads": torch.get_num_threads(),
            "kernels": kernels_path(self.device.type),  # the CPU kernels' instruction-set path
            "attention": self.backend.name,
            "weight_forms": weight_forms(self.model),  # "GGUF Q4_1 69%, Q8_0 31%", or "float32"
            "weight_bytes": budget.weights,  # once read: every tensor, quantized blocks included
            "memory": str(budget),
        }

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Swaps and copies first (in that order: a block swapped out may be reused by this very
        step), then the model."""
        if self.thread_governor is not None:
            self.thread_governor.adjust()
        if output.blocks_to_swap_out or output.blocks_to_swap_in or output.blocks_to_copy:
            cache = self.cache_engine
            cache.swap_out(output.blocks_to_swap_out)
            cache.swap_in(output.blocks_to_swap_in)
            cache.copy(output.blocks_to_copy)
        return self.runner.execute(output)

