"""Neox-style rotary embedding, in place on q and k, from a precomputed float32 cos/sin cache.

Layout: each head of ``D`` values is two halves ``(x1, x2)``; the result is ``(x1 cos - x2 sin,
x2 cos + x1 sin)`` with ``cos``/``sin`` ``[D / 2]`` taken at the token's position. That is transformers'
``x * cos + rotate_half(x) * sin`` (and model.py's ``_apply_rope``) with the duplicated halves of cos/sin
written once. The model's θ and RoPE scaling live in the cache (``reference.rope_cos_sin_cache`` from
``model.rope_inv_freq(config)``): the kernel only indexes it by ``positions``, which also makes it safe to
replay in a CUDA graph (positions is a static input buffer).

Computed in float32 and rounded once per element (model.py rounds cos/sin and each product to the
activation dtype; the difference is within an ulp or two of bf16). q and k may be strided views of the
fused qkv output; the last dim must be contiguous. Grid: one program per token, all heads of q and k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, stride_head, num_heads, cos, sin, half_dim, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < half_dim)
    first = x_ptr + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half_dim, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(first, out1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + half_dim, out2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_cache,
    num_q_heads,
    num_k_heads,
    half_dim,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    dim_mask = dims < half_dim
    cos = tl.load(cos_ptr + position * stride_cache + dims, mask=dim_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_cache + dims, mask=dim_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_q_token, stride_q_head, num_q_heads, cos, sin, half_dim, BLOCK_HQ,
                  BLOCK_HALF)
    _rotate_heads(k_ptr + token * stride_k_token, stride_k_head, num_k_heads, cos, sin, half_dim, BLOCK_HK,
                  BLOCK_HALF)


def rope_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hk, D]`` in place at ``positions`` ``[T]``; returns them.

    ``cos_cache``/``sin_cache``: ``[max_positions, D / 2]`` (float32, contiguous rows), every position in
    ``positions`` below max_positions (not checked on the device: that would be a host sync).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} need the same tokens and an even head_dim")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos_cache.stride(1) != 1 or sin_cache.stride() != cos_cache.stride():
        raise ValueError("q, k and the cos/sin caches need a contiguous last dim (and equal cache strides)")
    if cos_cache.shape[1] * 2 != head_dim:
        raise ValueError(f"cos/sin cache width {cos_cache.shape[1]} is not head_dim / 2 = {head_dim // 2}")
    if num_tokens == 0:
        return q, k
    num_k_heads = k.shape[1]
    half_dim = head_dim // 2
    _rope_kernel[(num_tokens,)](
        q, k, positions, cos_cache, sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_cache.stride(0),
        num_q_heads, num_k_heads, half_dim,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(num_k_heads),
        BLOCK_HALF=triton.next_power_of_2(half_dim),
    )
    return q, k
