"""Causal attention of a chunk of new tokens over the paged cache: prefill, chunked prefill, and the K+1
verification rows of speculative decoding, with decode (one new token) as the degenerate case.

Sequence ``s`` owns query rows ``query_start_loc[s] : query_start_loc[s+1]`` of the step's flattened
``[T, Hq, D]`` queries; they are its last ``q_len`` positions of a context of ``seq_lens[s]`` tokens whose
K/V (new tokens included: the cache write runs first) live in the paged cache. Query ``i`` sits at
position ``seq_len - q_len + i`` and sees keys ``0 ..`` that position.

Grid ``(num_seqs, Hq, ceil(max_q_len / BLOCK_M))``: one program per sequence, query head and block of
``BLOCK_M`` query rows; a program whose block lies past its sequence's ``q_len`` does no work (its loop
bound is 0 and every store is masked). Keys are walked in tiles of ``BLOCK_N`` positions up to the
block's last query position (the causal bound), gathered through the block table like the decode
kernel, with an online softmax in float32. fp8 caches are dequantised as in ``decode_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.kernels.decode_attention import LOG2E, MIN_DOT_ROWS, _load_kv_tile
from services.engine.kernels.fp8 import FP8_DTYPE


@triton.jit
def _extend_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    sm_scale_log2,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_slot,
    stride_cache_head,
    stride_table_seq,
    head_dim,
    block_size,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_FP8: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row_block = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    first_query_pos = seq_len - q_len

    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    query_pos = first_query_pos + rows
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    token_rows = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + token_rows[:, None] * stride_q_token + head * stride_q_head + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    # Keys up to the block's last real query position; nothing at all for a block past q_len.
    kv_end = tl.where(row_block * BLOCK_M < q_len, tl.minimum(seq_len, first_query_pos + (row_block + 1) * BLOCK_M),
                      0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_table_seq
    for tile_start in range(0, kv_end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        pos_mask = pos < kv_end
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
        visible = pos_mask[None, :] & (pos[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        # Every row sees position 0 in the first tile, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(q_ptr.dtype.element_ty).to(v.dtype)  # rounded to the activation dtype either way
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token_rows[:, None] * stride_out_token + head * stride_out_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def extend_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    max_query_len: int,
    block_m: int = 64,
    block_n: int = 64,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the step's queries ``q`` ``[T, Hq, D]`` over each sequence's paged context;
    returns ``[T, Hq, D]`` in q's dtype. ``max_query_len`` (the longest ``q_len``, a host int the caller
    already has) sizes the grid; ``seq_lens``, ``query_start_loc`` ``[B]``/``[B+1]`` and ``block_tables``
    as in ``AttentionMetadata``. Softmax scale ``D ** -0.5``; query head ``h`` reads KV head
    ``h // (Hq / Hkv)``."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(key_cache.shape)}")
    if q.stride(2) != 1 or not key_cache.is_contiguous() or not value_cache.is_contiguous():
        raise ValueError("q needs a contiguous last dim, the caches must be contiguous")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m = triton.next_power_of_2(max(MIN_DOT_ROWS, block_m))
    grid = (num_seqs, num_q_heads, triton.cdiv(max_query_len, block_m))
    _extend_kernel[grid](
        q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, k_scale, v_scale, out,
        head_dim**-0.5 * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        head_dim, block_size,
        GROUP=num_q_heads // num_kv_heads, BLOCK_M=block_m, BLOCK_N=triton.next_power_of_2(max(MIN_DOT_ROWS, block_n)),
        BLOCK_D=max(MIN_DOT_ROWS, triton.next_power_of_2(head_dim)), IS_FP8=key_cache.dtype == FP8_DTYPE,
        UPCAST_DOT=not q.is_cuda,
    )
    return out
