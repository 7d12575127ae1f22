"""What one step costs: the work in a control message, and the models that price it.

`StepWork` is what a step asks of the model, read off the scheduler's `SchedulerOutput`:
prompt tokens computed, sequences decoding one token, KV tokens read by attention, blocks
copied and swapped. Two cost models turn it into seconds (the profiles that use them, and the
scale each serves at, are in `profiles.py`):

- `RooflineCost`: the larger of FLOPs over peak and bytes over memory bandwidth, plus a fixed
  overhead; `A100_OPT13B` prices OPT-13B on one A100-40GB, the paper's setting.
- `LinearCost`: a linear model fitted by least squares to timed steps of the real model on
  this machine (`calibrate.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from pagedllm.core import SchedulerOutput
from pagedllm.core.reservation import num_reserved_seqs


@dataclass(slots=True)
class StepWork:
    prefill_tokens: int = 0  # prompt (or recomputed) tokens computed
    decode_seqs: int = 0  # sequences computing one generated token
    kv_tokens_read: int = 0  # KV positions attention reads, summed over sequences
    blocks_copied: int = 0  # device-to-device block copies (copy-on-write, reservation forks)
    blocks_swapped: int = 0  # blocks moved between device and CPU, both ways
    paged: bool = True  # read through block tables (else a contiguous kernel would do)

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs


def step_work(out: SchedulerOutput, paged: bool, static_batch: list | None = None) -> StepWork:
    """The work of one control message. With `static_batch` (FasterTransformer's static batching)
    the work is padded as a static batch computes it: every prompt as long as the longest, and
    every sequence of the batch decoding until the batch ends."""
    work = StepWork(
        blocks_copied=len(out.blocks_to_copy),
        blocks_swapped=len(out.blocks_to_swap_in) + len(out.blocks_to_swap_out),
        paged=paged,
    )
    longest_context = 0
    for item in out.seqs:
        n = len(item.token_ids)
        if n == 1 and item.num_output_tokens > 0:
            work.decode_seqs += 1
        else:
            work.prefill_tokens += n
        context = item.start_position + n
        work.kv_tokens_read += context
        longest_context = max(longest_context, context)
    if static_batch:
        if work.prefill_tokens:
            longest_prompt = max(g.seqs[0].num_prompt_tokens for g in static_batch)
            work.prefill_tokens = work.kv_tokens_read = len(static_batch) * longest_prompt
            work.decode_seqs = 0
        else:
            work.decode_seqs = sum(num_reserved_seqs(g) for g in static_batch)
            work.kv_tokens_read = work.decode_seqs * longest_context
    return work


@dataclass(frozen=True)
class Scale:
    """The serving setup a profile stands for."""

    max_model_len: int
    kv_slots: int  # device KV slots (tokens)
    block_size: int = 16
    cpu_swap_slots: int = 0  # CPU swap space, in tokens
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048

    def num_blocks(self, block_size: int | None = None) -> int:
        return self.kv_slots // (block_size or self.block_size)

    def num_cpu_blocks(self, block_size: int | None = None) -> int:
        return self.cpu_swap_slots // (block_size or self.block_size)


@dataclass(frozen=True)
class RooflineCost:
    """A step takes max(FLOPs / peak, bytes / bandwidth) plus a fixed overhead.

    FLOPs: 2 per parameter per token computed. Bytes: the weights once per step, the KV of
    every position attention reads (slower through block tables: `1 + paged_overhead_tokens /
    block_size` times, which at block size 16 is the paper's 20-26% kernel overhead), the KV of
    the new tokens written, and copied blocks read and written. Swaps cross PCIe, one copy call
    per block per layer for keys and one for values, each with a fixed latency.
    """

    name: str
    num_params: float
    weight_bytes: float
    kv_bytes_per_token: float
    num_layers: int
    peak_flops: float
    memory_bandwidth: float
    step_overhead_s: float
    paged_overhead_tokens: float
    pcie_bandwidth: float
    copy_call_s: float
    block_size: int = 16

    def with_block_size(self, block_size: int) -> "RooflineCost":
        return replace(self, block_size=block_size)

    def step_seconds(self, work: StepWork) -> float:
        flops = 2 * self.num_params * work.num_tokens
        kv_read = work.kv_tokens_read * self.kv_bytes_per_token
        if work.paged:
            kv_read *= 1 + self.paged_overhead_tokens / self.block_size
        block_bytes = self.block_size * self.kv_bytes_per_token
        moved = (
            self.weight_bytes
            + kv_read
            + work.num_tokens * self.kv_bytes_per_token
            + 2 * work.blocks_copied * block_bytes
        )
        seconds = max(flops / self.peak_flops, moved / self.memory_bandwidth) + self.step_overhead_s
        return seconds + work.blocks_swapped * self.swap_seconds_per_block() / 2

    def swap_seconds_per_block(self) -> float:
        """One block out and back in."""
        one_way = 2 * self.num_layers * self.copy_call_s + self.block_size * self.kv_bytes_per_token / self.pcie_bandwidth
        return 2 * one_way

    def recompute_seconds_per_token(self) -> float:
        return 2 * self.num_params / self.peak_flops

    def describe(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LinearCost:
    """A step takes c_step + c_prefill * prompt tokens + c_decode * decoding sequences +
    c_kv * KV tokens read + c_copy * blocks copied + c_swap * blocks swapped, in seconds:
    coefficients fitted to timed steps of the real model (`calibrate.py`)."""

    name: str
    c_step: float
    c_prefill: float
    c_decode: float
    c_kv: float
    c_copy_token: float  # per token of a copied block
    c_swap_token: float  # per token of a swapped block, one way
    block_size: int = 16
    fit: dict | None = None  # how well the fit explains the timed steps

    def with_block_size(self, block_size: int) -> "LinearCost":
        return replace(self, block_size=block_size)

    def step_seconds(self, work: StepWork) -> float:
        return (
            self.c_step
            + self.c_prefill * work.prefill_tokens
            + self.c_decode * work.decode_seqs
            + self.c_kv * work.kv_tokens_read
            + self.c_copy_token * self.block_size * work.blocks_copied
            + self.c_swap_token * self.block_size * work.blocks_swapped
        )

    def swap_seconds_per_block(self) -> float:
        return 2 * self.c_swap_token * self.block_size

    def recompute_seconds_per_token(self) -> float:
        return self.c_prefill

    def describe(self) -> dict:
        return asdict(self)


# OPT-13B (40 layers, hidden 5120, fp16) on one A100-40GB.
A100_OPT13B = RooflineCost(
    name="a100-opt13b",
    num_params=12.85e9,
    weight_bytes=26e9,
    kv_bytes_per_token=2 * 40 * 5120 * 2,  # keys and values, 40 layers, 5120 wide, 2 bytes: 800 KiB
    num_layers=40,
    peak_flops=312e12,  # bf16/fp16 dense tensor cores
    memory_bandwidth=1.5e12,  # HBM2 (1.555 TB/s peak)
    step_overhead_s=3e-3,  # scheduling, sampling, kernel launches per step
    paged_overhead_tokens=4.0,  # block-table indirection: 1 + 4/16 = 1.25x at block size 16
    pcie_bandwidth=25e9,  # PCIe 4.0 x16, achieved
    copy_call_s=5e-6,  # one cudaMemcpyAsync
)
