"""KV-cache write: scatter each new token's K and V ``[Hkv, D]`` into its flat cache slot.

Same contract as ``KVCache.write`` (attention.py): the per-layer caches are ``[num_blocks, block_size,
Hkv, D]``; token ``t`` goes to flat slot ``slot_mapping[t]``. With an fp8 cache the value stored is
``clamp(x / scale, ±448)`` cast to e4m3 (round to nearest even on the GPU), the scale read from a
one-element float32 tensor (``KVCache.k_scales[layer]``), so no host sync and the kernel can be replayed
in a CUDA graph. A negative slot skips the token: padded rows of a CUDA-graph batch carry slot -1.

Grid: one program per token, all of its heads (``Hkv * D`` values as one masked block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.kernels.fp8 import FP8_DTYPE, FP8_MAX


@triton.jit
def _store_kv(src_ptr, stride_src_head, cache_ptr, slot, stride_cache_slot, stride_cache_head, scale_ptr,
              num_heads, head_dim, IS_FP8: tl.constexpr, FP8_LIMIT: tl.constexpr, BLOCK_H: tl.constexpr,
              BLOCK_D: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # The slot test is broadcast to the block explicitly: the interpreter rejects a scalar-and-block mask.
    slot_block = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot
    mask = (heads[:, None] < num_heads) & (dims[None, :] < head_dim) & (slot_block >= 0)
    x = tl.load(src_ptr + heads[:, None] * stride_src_head + dims[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if IS_FP8:
        scale = tl.load(scale_ptr)
        x = tl.minimum(tl.maximum(x / scale, -FP8_LIMIT), FP8_LIMIT)
    dest = cache_ptr + slot * stride_cache_slot + heads[:, None] * stride_cache_head + dims[None, :]
    tl.store(dest, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cache_slot,
    stride_cache_head,
    num_heads,
    head_dim,
    IS_FP8: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    _store_kv(k_ptr + token * stride_k_token, stride_k_head, key_cache_ptr, slot, stride_cache_slot,
              stride_cache_head, k_scale_ptr, num_heads, head_dim, IS_FP8, FP8_LIMIT, BLOCK_H, BLOCK_D)
    _store_kv(v_ptr + token * stride_v_token, stride_v_head, value_cache_ptr, slot, stride_cache_slot,
              stride_cache_head, v_scale_ptr, num_heads, head_dim, IS_FP8, FP8_LIMIT, BLOCK_H, BLOCK_D)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Store ``k``, ``v`` ``[T, Hkv, D]`` (strided views allowed, contiguous last dim) into ``key_cache`` /
    ``value_cache`` ``[num_blocks, block_size, Hkv, D]`` at ``slot_mapping`` ``[T]``; slots < 0 are skipped.

    ``k_scale``/``v_scale``: one-element float32 tensors, read only when the cache dtype is fp8.
    """
    num_tokens, num_heads, head_dim = k.shape
    if v.shape != k.shape or key_cache.shape[2:] != (num_heads, head_dim) or value_cache.shape != key_cache.shape:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} do not fit cache {tuple(key_cache.shape)}")
    if k.stride(2) != 1 or v.stride(2) != 1 or not key_cache.is_contiguous() or not value_cache.is_contiguous():
        raise ValueError("k and v need a contiguous last dim, the caches must be contiguous")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, key_cache, value_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), key_cache.stride(1), key_cache.stride(2),
        num_heads, head_dim,
        IS_FP8=key_cache.dtype == FP8_DTYPE, FP8_LIMIT=FP8_MAX,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
