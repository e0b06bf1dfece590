"""Paged attention for one-token (decode) queries: split-KV ("flash-decoding") with a reduce step, GQA.

Stage 1, grid ``(num_seqs, num_kv_heads, num_splits)``: each program takes one sequence, one KV head and
*all* the query heads that read it (GQA: ``Hq / Hkv`` heads padded to a block of >= 16 rows, so the
scores are one ``tl.dot`` and each K/V tile is loaded once per group, not once per query head), and one
contiguous slice of the context. It walks the slice in tiles of ``BLOCK_N`` positions, turning each
position ``p`` into its cache slot through the block table (``table[p // block_size] * block_size +
p % block_size``, so any block size works, including non-powers of two), and keeps an online softmax.
It writes the slice's normalised partial output and its log-sum-exp (base 2).

Stage 2, grid ``(num_seqs, Hq)``: combines the slices' partials weighted by ``exp2(lse_i - max lse)``.

The slice length is derived on the device from ``seq_lens`` (``ceil(ceil(len / splits) / BLOCK_N) *
BLOCK_N``), so nothing is read back to the host and the launch shape depends only on the batch size and
``num_splits``: a CUDA graph captured for a batch bucket replays for any context lengths. Empty slices
(short sequences, or the padded rows of a graph batch with ``seq_len = 0``) write lse = -inf and drop out
of the reduce; a row with no context at all gets zeros.

Numerics follow ``TorchPagedAttention``: keys and values are read in the cache dtype and, for fp8,
dequantised as ``(stored * scale)`` rounded to the query dtype; scores and the softmax are float32; the
probabilities are rounded to the activation dtype for the P @ V product (flash attention's convention).

``UPCAST_DOT`` (set off CUDA, i.e. under the interpreter) runs the two products in float32 on the same
rounded operands: triton 3.9's interpreter computes bf16 ``tl.dot`` wrongly (results off by ~1e9 in our
tests). A product of two bf16/fp16 values is exact in float32, so only the summation order differs from
the GPU's tensor-core path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from services.engine.kernels.fp8 import FP8_DTYPE

LOG2E = 1.4426950408889634
MIN_DOT_ROWS = 16  # tl.dot needs M, N, K >= 16 on NVIDIA GPUs


@triton.jit
def _load_kv_tile(cache_ptr, slots, kv_head, stride_slot, stride_head, dims, mask, scale_ptr, out_dtype,
                  IS_FP8: tl.constexpr):
    """``[BLOCK_N, BLOCK_D]`` of one KV head at ``slots``, in ``out_dtype`` (fp8 dequantised with its scale)."""
    tile = tl.load(cache_ptr + slots[:, None] * stride_slot + kv_head * stride_head + dims[None, :], mask=mask,
                   other=0.0)
    if IS_FP8:
        tile = tile.to(tl.float32) * tl.load(scale_ptr)
    return tile.to(out_dtype)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    sm_scale_log2,
    stride_q_seq,
    stride_q_head,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    head_dim,
    block_size,
    GROUP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, BLOCK_H)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_table_seq
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        block_ids = tl.load(table + pos // block_size, mask=pos_mask, other=0).to(tl.int64)
        slots = block_ids * block_size + pos % block_size
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        k = _load_kv_tile(key_cache_ptr, slots, kv_head, stride_cache_slot, stride_cache_head, dims, kv_mask,
                          k_scale_ptr, q_ptr.dtype.element_ty, IS_FP8)
        v = _load_kv_tile(value_cache_ptr, slots, kv_head, stride_cache_slot, stride_cache_head, dims, kv_mask,
                          v_scale_ptr, q_ptr.dtype.element_ty, IS_FP8)
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale_log2
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(q_ptr.dtype.element_ty).to(v.dtype)  # rounded to the activation dtype either way
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    has_context = l_i > 0
    out = acc / tl.where(has_context, l_i, 1.0)[:, None]
    lse = tl.where(has_context, m_i + tl.log2(tl.where(has_context, l_i, 1.0)), float("-inf"))
    out_ptrs = (partial_out_ptr + seq * stride_po_seq + heads[:, None] * stride_po_head + split * stride_po_split
                + dims[None, :])
    tl.store(out_ptrs, out, mask=row_mask[:, None] & dim_mask[None, :])
    tl.store(partial_lse_ptr + seq * stride_pl_seq + heads * stride_pl_head + split, lse, mask=row_mask)


@triton.jit
def _decode_reduce_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    stride_out_seq,
    stride_out_head,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < NUM_SPLITS
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    lse = tl.load(partial_lse_ptr + seq * stride_pl_seq + head * stride_pl_head + splits, mask=split_mask,
                  other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    safe_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - safe_max)  # 0 for empty splits
    partial = tl.load(partial_out_ptr + seq * stride_po_seq + head * stride_po_head
                      + splits[:, None] * stride_po_split + dims[None, :],
                      mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    total = tl.sum(weights, axis=0)
    out = tl.sum(weights[:, None] * partial, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_mask)


def default_num_splits(max_seq_len: int, num_seqs: int, num_kv_heads: int, *, num_sms: int = 132,
                       min_tokens_per_split: int = 256, max_splits: int = 32) -> int:
    """Splits per sequence: enough programs to fill ``num_sms`` (H100/H200: 132) at small batches, but no
    split shorter than ``min_tokens_per_split`` (the reduce and the partial writes cost more than they
    save below that). A power of two, so graphs captured per bucket see few distinct values."""
    by_length = max(1, max_seq_len // min_tokens_per_split)
    by_occupancy = max(1, math.ceil(num_sms / max(1, num_seqs * num_kv_heads)))
    splits = min(by_length, by_occupancy, max_splits)
    return 1 << (splits.bit_length() - 1)


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    num_splits: int,
    block_n: int = 32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, Hq, D]`` (row ``b`` is the one new token of sequence ``b``) over the first
    ``seq_lens[b]`` positions of sequence ``b``'s paged context; returns ``[B, Hq, D]`` in q's dtype.

    ``key_cache``/``value_cache``: ``[num_blocks, block_size, Hkv, D]``; ``block_tables`` ``[B, max_blocks]``
    (int32 or int64) covering every position below ``seq_lens``; ``k_scale``/``v_scale`` one-element
    float32 tensors (read only for an fp8 cache). Softmax scale ``D ** -0.5``.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(key_cache.shape)}")
    if q.stride(2) != 1 or not key_cache.is_contiguous() or not value_cache.is_contiguous():
        raise ValueError("q needs a contiguous last dim, the caches must be contiguous")
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    partial_out = torch.empty((num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    partial_lse = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    block_d = max(MIN_DOT_ROWS, triton.next_power_of_2(head_dim))
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, partial_out, partial_lse,
        head_dim**-0.5 * LOG2E,
        q.stride(0), q.stride(1), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        head_dim, block_size,
        GROUP=group, NUM_SPLITS=num_splits, BLOCK_H=max(MIN_DOT_ROWS, triton.next_power_of_2(group)),
        BLOCK_N=triton.next_power_of_2(max(MIN_DOT_ROWS, block_n)), BLOCK_D=block_d,
        IS_FP8=key_cache.dtype == FP8_DTYPE,
        UPCAST_DOT=not q.is_cuda,
    )
    _decode_reduce_kernel[(num_seqs, num_q_heads)](
        partial_out, partial_lse, out,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1), out.stride(0), out.stride(1),
        head_dim,
        NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
    )
    return out
