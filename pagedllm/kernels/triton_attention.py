"""PagedAttention kernels in Triton: the KV write and one attention kernel for every step.

Pools are [num_blocks, num_kv_heads, block_size, head_dim] (keys and values alike), so the
`block_size` keys of one KV head in one block are one contiguous run.

`write_kv` (vLLM's reshape_and_cache). Grid (cdiv(num_tokens, BLOCK_T),): a program copies the
keys and values of BLOCK_T tokens, all KV heads at once, each into the slot `slot_mapping`
names, casting to the pool's dtype; a token whose slot is negative (padding) is skipped. It
reads the projection's output through its strides, without a copy.

`paged_attention`. The batch is cut into work items, each a run of at most BLOCK_M // GROUP
consecutive query tokens of one sequence (a decode is a one-token item; a prompt chunk
several). Grid
(num_items, num_kv_heads, num_partitions): a program takes one item and one KV head and
computes the whole query-head group of that KV head, so keys and values are read once per
group, never repeated per query head (grouped-query attention):

- Its BLOCK_M query rows are the pairs (token, head of the group), row r being token
  r // GROUP and query head kv_head * GROUP + r % GROUP; rows past the item's tokens are masked.
  GROUP need not be a power of two.
- It walks the keys the item can see in tiles of TILE_N positions. Each position's block comes
  from the block table (position // BLOCK_SIZE), so a tile may span several blocks, or part of
  one, and the blocks may lie anywhere in the pool. Query token j of the item, at context
  position first_position + j, sees the keys at positions <= its own (causal), so prompt tokens
  over a cached context (prefix-cache hits, chunked prompts, recomputation after preemption)
  and decodes are one case: a step mixing them is one launch.
- Softmax is online (flash attention): a running maximum m and sum l per row, in base 2 (the
  scale is folded with log2(e) so exp2 does the work); when a tile raises the maximum, the
  accumulator and the sum are rescaled by exp2(m_old - m_new). Dots accumulate in float32;
  float32 inputs multiply exactly ("ieee"), not in TF32; with 16-bit values the probabilities
  are multiplied as two 16-bit parts (`_dot_probabilities`), so a 16-bit output is the float32
  result rounded once.
- Sliding windows (SLIDING_WINDOW W > 0, a compile-time constant: 0 compiles the loop as
  without one): query token j also sees no key W or more positions back, so the item's tiles
  start at the one holding its first token's first visible key, and keys before that position
  are never loaded (their blocks may have left the window and gone back to the pool).
- Logit soft-capping (SOFT_CAP c > 0, Gemma 2): scores (after the scale) become
  c * tanh(score / c) before the softmax.
- Flash-decoding: when few programs would run (few sequences times KV heads against the
  device's parallelism), each item's visible context is split into NUM_PARTITIONS equal runs of
  tiles, one program each. A partition writes its unnormalized accumulator with its m and l;
  `_merge_partitions_kernel` (grid (num_tokens, num_heads)) rescales the partitions to their
  common maximum and divides by the summed l. With one partition the kernel normalizes and
  writes the output itself.

On a CPU the same kernels run in Triton's interpreter (tests). Where the interpreter's numbers
would differ from the GPU's (its float32 to bfloat16 cast truncates; its dot takes no
bfloat16), `_cast` and `_dot` emulate the GPU, so the interpreter checks the GPU's arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# log2(e): the kernels compute exp(x) as exp2(x * log2(e)).
LOG2E = 1.4426950408889634

# Whether the kernels run in Triton's interpreter: Triton decides when it is imported (with
# TRITON_INTERPRET=1), for its own library kernels (`tl.max`, ...) as for ours.
INTERPRETED = not isinstance(tl.max, triton.JITFunction)
_INTERPRETED = tl.constexpr(INTERPRETED)
# Elements (tokens times KV heads times head size) one program of the KV write copies, at most.
WRITE_TILE_ELEMENTS = 4096


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """x.to(dtype), rounding to nearest even as the GPU does. Triton's interpreter truncates
    float32 to bfloat16, so there the rounding is done on the bits, and the interpreter's
    numbers are the GPU's."""
    if _INTERPRETED and dtype == tl.bfloat16 and x.dtype == tl.float32:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _dot(a, b):
    """a @ b with a float32 accumulator; float32 operands multiply exactly ("ieee", not TF32).
    The interpreter's dot takes no bfloat16: there the operands are widened to float32 first,
    which gives the same products (a product of two bfloat16 values is exact in float32)."""
    if _INTERPRETED and a.dtype == tl.bfloat16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _dot_probabilities(p, v):
    """p @ v for float32 probabilities p. With 16-bit values, p is split into its 16-bit
    rounding and the rest, each multiplied on the tensor cores: about 16 significant bits of p
    instead of 8 (bfloat16), for one more dot where prompts are computed and none where the
    loads of decoding bound the time."""
    if v.dtype == tl.float32:
        return _dot(p, v)
    p_high = _cast(p, v.dtype)
    p_low = _cast(p - p_high.to(tl.float32), v.dtype)
    return _dot(p_high, v) + _dot(p_low, v)


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], any strides but the last
    value_ptr,
    key_cache_ptr,  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64: block * BLOCK_SIZE + offset
    num_tokens,
    key_stride_token,
    key_stride_head,
    value_stride_token,
    value_stride_head,
    cache_stride_block,
    cache_stride_head,
    cache_stride_slot,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_HEADS_PADDED: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
):
    # A [BLOCK_T, KV_HEADS_PADDED * HEAD_DIM_PADDED] tile: a row is one token, its KV heads side by side.
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_valid = tokens < num_tokens
    tokens = tokens.to(tl.int64)
    columns = tl.arange(0, KV_HEADS_PADDED * HEAD_DIM_PADDED)
    heads = columns // HEAD_DIM_PADDED
    dims = columns % HEAD_DIM_PADDED
    slots = tl.load(slot_mapping_ptr + tokens, mask=token_valid, other=-1)
    # A negative slot is padding (a CUDA graph's rows past the batch): nothing is written.
    mask = (slots >= 0)[:, None] & ((heads < NUM_KV_HEADS) & (dims < HEAD_DIM))[None, :]
    cache_offsets = (
        ((slots // BLOCK_SIZE) * cache_stride_block + (slots % BLOCK_SIZE) * cache_stride_slot)[:, None]
        + (heads * cache_stride_head + dims)[None, :]
    )
    key_offsets = tokens[:, None] * key_stride_token + (heads * key_stride_head + dims)[None, :]
    key = tl.load(key_ptr + key_offsets, mask=mask)
    if key.dtype != key_cache_ptr.dtype.element_ty:
        key = _cast(key, key_cache_ptr.dtype.element_ty)
    tl.store(key_cache_ptr + cache_offsets, key, mask=mask)
    value_offsets = tokens[:, None] * value_stride_token + (heads * value_stride_head + dims)[None, :]
    value = tl.load(value_ptr + value_offsets, mask=mask)
    if value.dtype != value_cache_ptr.dtype.element_ty:
        value = _cast(value, value_cache_ptr.dtype.element_ty)
    tl.store(value_cache_ptr + cache_offsets, value, mask=mask)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    partial_out_ptr,  # [num_tokens, num_heads, NUM_PARTITIONS, HEAD_DIM_PADDED] float32 (partitions only)
    partial_max_ptr,  # [num_tokens, num_heads, NUM_PARTITIONS] float32, base 2 (partitions only)
    partial_sum_ptr,  # [num_tokens, num_heads, NUM_PARTITIONS] float32 (partitions only)
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32
    items_ptr,  # [num_items, 4] int32: sequence, first token, number of tokens, first position
    scale_log2,  # softmax scale * log2(e)
    query_stride_token,
    query_stride_head,
    out_stride_token,
    out_stride_head,
    cache_stride_block,
    cache_stride_head,
    cache_stride_slot,
    block_table_stride,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows of a program: (token, head of the group) pairs
    TILE_N: tl.constexpr,  # key positions per iteration
    NUM_PARTITIONS: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr = 0,  # keys each token sees, itself included; 0: its whole context
    SOFT_CAP: tl.constexpr = 0.0,  # scores soft-capped at this; 0: not
):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    seq = tl.load(items_ptr + item * 4)
    first_token = tl.load(items_ptr + item * 4 + 1)
    num_tokens = tl.load(items_ptr + item * 4 + 2)
    first_position = tl.load(items_ptr + item * 4 + 3)

    rows = tl.arange(0, BLOCK_M)
    row_token = rows // GROUP
    row_head = kv_head * GROUP + rows % GROUP
    row_valid = row_token < num_tokens
    row_position = first_position + row_token
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM
    token_index = (first_token + row_token).to(tl.int64)

    # q: [BLOCK_M, HEAD_DIM_PADDED]
    q = tl.load(
        query_ptr + token_index[:, None] * query_stride_token + row_head[:, None] * query_stride_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )

    # The item's last token sees the latest keys, its first the earliest (from its window's
    # start); this program's partition is a run of the tiles between.
    context_end = first_position + num_tokens
    if SLIDING_WINDOW > 0:
        window_start = tl.maximum(first_position - SLIDING_WINDOW + 1, 0)
    else:
        window_start = 0
    first_tile = window_start // TILE_N
    num_tiles = (context_end + TILE_N - 1) // TILE_N
    if NUM_PARTITIONS == 1:
        tile_start = first_tile
        tile_end = num_tiles
    else:
        tiles_per_partition = (num_tiles - first_tile + NUM_PARTITIONS - 1) // NUM_PARTITIONS
        tile_start = first_tile + partition * tiles_per_partition
        tile_end = tl.minimum(tile_start + tiles_per_partition, num_tiles)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    head_offset = kv_head.to(tl.int64) * cache_stride_head
    for tile in range(tile_start, tile_end):
        positions = tile * TILE_N + tl.arange(0, TILE_N)
        position_valid = positions < context_end
        if SLIDING_WINDOW > 0:
            position_valid = position_valid & (positions >= window_start)
        blocks = tl.load(block_table + positions // BLOCK_SIZE, mask=position_valid, other=0).to(tl.int64)
        # kv_offsets: [TILE_N, HEAD_DIM_PADDED]
        kv_offsets = (
            blocks[:, None] * cache_stride_block
            + head_offset
            + (positions % BLOCK_SIZE)[:, None] * cache_stride_slot
            + dims[None, :]
        )
        kv_mask = position_valid[:, None] & dim_valid[None, :]
        k = tl.load(key_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if k.dtype != q.dtype:
            k = _cast(k, q.dtype)
        # s: [BLOCK_M, TILE_N], in base 2
        if SOFT_CAP > 0.0:
            # c * tanh(x / c), tanh(y) = 2 sigmoid(2y) - 1; scale_log2 / LOG2E is the scale.
            s = _dot(q, tl.trans(k)) * (scale_log2 / LOG2E)
            s = (SOFT_CAP * (2.0 * tl.sigmoid(s * (2.0 / SOFT_CAP)) - 1.0)) * LOG2E
        else:
            s = _dot(q, tl.trans(k)) * scale_log2
        visible = positions[None, :] <= row_position[:, None]
        if SLIDING_WINDOW > 0:
            visible = visible & (positions[None, :] > row_position[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row that has seen no key yet keeps m = -inf; exp2 against 0 then gives it zeros, not NaN.
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_base[:, None])
        alpha = tl.exp2(m - m_base)
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(value_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if v.dtype != q.dtype:
            v = _cast(v, q.dtype)
        acc = acc * alpha[:, None] + _dot_probabilities(p, v)
        m = m_new

    if NUM_PARTITIONS == 1:
        # l is 0 only on rows past the item's tokens (padding), which are not stored.
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(
            out_ptr + token_index[:, None] * out_stride_token + row_head[:, None] * out_stride_head + dims[None, :],
            _cast(out, out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        num_heads = tl.num_programs(1) * GROUP
        slot = (token_index * num_heads + row_head) * NUM_PARTITIONS + partition
        tl.store(partial_max_ptr + slot, m, mask=row_valid)
        tl.store(partial_sum_ptr + slot, l, mask=row_valid)
        tl.store(
            partial_out_ptr + slot[:, None] * HEAD_DIM_PADDED + dims[None, :],
            acc,
            mask=row_valid[:, None],
        )


@triton.jit
def _merge_partitions_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    partial_out_ptr,  # [num_tokens, num_heads, NUM_PARTITIONS, HEAD_DIM_PADDED] float32
    partial_max_ptr,  # [num_tokens, num_heads, NUM_PARTITIONS] float32, base 2
    partial_sum_ptr,  # [num_tokens, num_heads, NUM_PARTITIONS] float32
    out_stride_token,
    out_stride_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    NUM_PARTITIONS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    partitions = tl.arange(0, NUM_PARTITIONS)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    slots = (token * num_heads + head) * NUM_PARTITIONS + partitions
    m = tl.load(partial_max_ptr + slots)
    # A partition past the end of a short context (or, with a window, before a token's window)
    # saw no key: m = -inf, weight 0. Some partition holds the token itself, so the common
    # maximum is finite.
    weight = tl.exp2(m - tl.max(m, axis=0))
    total = tl.sum(tl.load(partial_sum_ptr + slots) * weight, axis=0)
    acc = tl.load(partial_out_ptr + slots[:, None] * HEAD_DIM_PADDED + dims[None, :])
    out = tl.sum(acc * weight[:, None], axis=0) / total
    out_offsets = token * out_stride_token + head * out_stride_head + dims
    tl.store(out_ptr + out_offsets, _cast(out, out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


if INTERPRETED != (not isinstance(_paged_attention_kernel, triton.JITFunction)):
    raise ImportError(
        "TRITON_INTERPRET changed between the import of triton and of pagedllm's Triton kernels; set it (or not) "
        "before anything imports triton."
    )


def _padded(n: int) -> int:
    """The power of two >= n, and at least 16 (the smallest dot Triton compiles)."""
    return max(16, triton.next_power_of_2(n))


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's key and value ([num_tokens, num_kv_heads, head_dim]) into the slot
    `slot_mapping` names (int64: block * block_size + offset) of the pools."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(2) == 1 and value.stride(2) == 1 and key_cache.stride() == value_cache.stride()
    block_size = key_cache.shape[2]
    kv_heads_padded, head_dim_padded = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    block_t = max(1, min(16, WRITE_TILE_ELEMENTS // (kv_heads_padded * head_dim_padded)))
    _write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key, value, key_cache, value_cache, slot_mapping, num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, KV_HEADS_PADDED=kv_heads_padded, HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_SIZE=block_size, BLOCK_T=block_t,
    )


def launch_options(num_warps: int | None, num_stages: int | None) -> dict:
    """The launch keywords that are set (Triton applies its defaults to the others)."""
    options = {}
    if num_warps is not None:
        options["num_warps"] = num_warps
    if num_stages is not None:
        options["num_stages"] = num_stages
    return options


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    items: torch.Tensor,
    scale: float,
    block_m: int,
    tile_n: int,
    num_partitions: int = 1,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> None:
    """Attention of every query token over its sequence's paged context, into `out`.

    `items` ([num_items, 4] int32, on the device) lists the work: (sequence, first token in the
    flat batch, number of tokens, context position of the first token); an item has at most
    block_m // (num_heads // num_kv_heads) tokens. `block_m` and `tile_n` are powers of two
    >= 16; `num_partitions` (a power of two) splits each item's context for flash-decoding.
    Each token sees at most `sliding_window` keys (itself included), and its scores are
    soft-capped at `logits_soft_cap`; None for neither. `num_warps` and `num_stages` set the
    launch (None: Triton's defaults; the interpreter ignores both).
    """
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    group = num_heads // num_kv_heads
    num_items = items.shape[0]
    if num_items == 0:
        return
    assert query.stride(2) == 1 and out.stride(2) == 1 and key_cache.stride() == value_cache.stride()
    assert block_m >= group and num_partitions >= 1 and num_partitions & (num_partitions - 1) == 0
    head_dim_padded = _padded(head_dim)
    if num_partitions == 1:
        partial_out = partial_max = partial_sum = out  # not read: the kernel writes `out` itself
    else:
        shape = (num_tokens, num_heads, num_partitions)
        partial_out = torch.empty(*shape, head_dim_padded, dtype=torch.float32, device=out.device)
        partial_max = torch.empty(shape, dtype=torch.float32, device=out.device)
        partial_sum = torch.empty_like(partial_max)
    _paged_attention_kernel[(num_items, num_kv_heads, num_partitions)](
        out, partial_out, partial_max, partial_sum, query, key_cache, value_cache, block_tables, items,
        scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, TILE_N=tile_n, NUM_PARTITIONS=num_partitions,
        SLIDING_WINDOW=sliding_window or 0, SOFT_CAP=float(logits_soft_cap or 0.0),
        **launch_options(num_warps, num_stages),
    )
    if num_partitions > 1:
        _merge_partitions_kernel[(num_tokens, num_heads)](
            out, partial_out, partial_max, partial_sum, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded, NUM_PARTITIONS=num_partitions,
        )
