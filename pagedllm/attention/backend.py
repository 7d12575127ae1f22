"""The attention backend interface and the metadata every backend reads.

A backend owns the KV cache layout (`kv_cache_shape`), writes new keys and values into the
block pools (`write_kv`) and computes attention by reading the pools through block tables
(`forward`). The model never looks inside the pools, so a faster backend drops in unchanged.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.config import ATTENTION_BACKENDS


@dataclass
class AttentionMetadata:
    """Where one step's tokens go in the paged KV cache and what each sequence reads back.

    The batch is flat: sequence i owns query tokens `query_start_loc[i]:query_start_loc[i+1]`,
    which sit at the last `query_lens[i]` positions of its `seq_lens[i]` context tokens.

    `slot_mapping` and `block_tables` are those of KV cache group 0 (`kv_spec.kv_cache_groups`);
    a model whose layers form several groups has the others' in `other_groups`, and each layer
    reads its own group's (`for_group`). In a sliding-window group, entries before a sequence's
    window hold a placeholder block id (0): kernels never read them.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    seq_lens: torch.Tensor  # [num_seqs] int64: context length after this step's tokens are written
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32; row i valid up to ceil(seq_lens[i] / block_size)
    query_lens: list[int]
    seq_lens_list: list[int]
    block_size: int
    # Sequences are ordered decodes first: the first `num_decodes` have exactly one query token.
    num_decodes: int = 0
    # Whatever a backend derives from this metadata once per step and reuses in every layer.
    backend_plan: Any = None
    # The same step as seen by KV cache groups 1, 2, ...: their own slots and block tables.
    other_groups: list["AttentionMetadata"] = field(default_factory=list)

    def for_group(self, group: int) -> "AttentionMetadata":
        """The metadata of KV cache group `group`."""
        return self if group == 0 else self.other_groups[group - 1]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list, default=0)


class AttentionBackend:
    """Interface. Tensors: query [num_tokens, num_heads, head_dim]; key/value
    [num_tokens, num_kv_heads, head_dim]; output [num_tokens, num_heads, head_dim]."""

    name = "abstract"
    block_dim = 0  # the dimension of the pool tensors that indexes blocks (for copies and swaps)

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        raise NotImplementedError

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        raise NotImplementedError

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Attention of each query token over its sequence's cached context (already including
        this step's keys and values). `key`/`value` are this step's fresh tensors, which a backend
        may use directly where a sequence has no earlier context.

        With `sliding_window` W, a query at position p sees only keys at p - W + 1 .. p; with
        `logits_soft_cap` c, scores (after `scale`) become c * tanh(score / c) before the softmax
        (Gemma 2)."""
        raise NotImplementedError


def _triton_available(device: torch.device) -> bool:
    """Whether Triton can serve `device`. On a GPU it is imported to be sure; elsewhere only
    found, since on a CPU it must be imported after its interpreter is chosen (the Triton
    backend does that)."""
    if device.type != "cuda":
        return importlib.util.find_spec("triton") is not None
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def get_attention_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    batch_invariant: bool = False,
) -> AttentionBackend:
    """`auto` picks the Triton kernels on a GPU (when Triton imports), the fast CPU kernel on a
    CPU (float32 and bfloat16, when it builds), else the reference backend."""
    if name == "auto":
        if device.type == "cuda":
            name = "triton" if _triton_available(device) else "reference"
        else:
            from pagedllm.kernels import build as cpu_kernels
            from pagedllm.attention.cpu import supports

            fast = device.type == "cpu" and supports(dtype, cache_dtype or dtype) and cpu_kernels.available()
            name = "cpu" if fast else "reference"
    if batch_invariant and name != "cpu":
        raise ValueError(
            f"batch_invariant=True needs the cpu attention backend (float32 or bfloat16 on a CPU, with the CPU "
            f"kernels built), not {name!r}; drop batch_invariant or use attention_backend='cpu'."
        )
    if name == "reference":
        from pagedllm.attention.reference import ReferenceAttentionBackend

        return ReferenceAttentionBackend()
    if name == "cpu":
        from pagedllm.attention.cpu import CPUAttentionBackend

        return CPUAttentionBackend(batch_invariant)
    if name == "triton":
        if not _triton_available(device):
            raise ValueError(
                "attention_backend='triton' needs the triton package (pip install triton), which is not installed "
                "or does not import."
            )
        from pagedllm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    raise ValueError(f"Unknown attention backend {name!r}; choose one of: {', '.join(ATTENTION_BACKENDS)}.")
