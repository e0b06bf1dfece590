"""Quantized GEMMs for CUDA that dequantise inside the tile: ``y [M, N] = x [M, K] @ W.T`` with W stored packed.

* :func:`int_gemm` (:func:`int4_gemm`): weight-only INT4/INT8 in the GPTQ layout (``qweight`` int32
  ``[K*bits/32, N]``, element k of a word in bits ``k*bits``..; ``scales`` and float ``zeros`` ``[groups, N]``;
  ``g_idx`` ``[K]`` each input row's group, which also covers GPTQ's act order). AWQ and compressed-tensors
  pack-quantized checkpoints reach it after repacking into this layout (model/quant/kernel_weight.py). Hopper
  has no INT4 MMA: the tile is dequantised in registers, cast to x's dtype and multiplied on the tensor cores
  in that dtype.
* :func:`nvfp4_gemm`: weight-only NVFP4 (``packed`` uint8 ``[N, K/2]``, low nibble first; ``scale`` fp8 e4m3
  ``[N, K/16]``; a float multiplier per output row for the global scale, which differs between fused parts):
  Hopper has no FP4 MMA either.
* :func:`fp8_scaled_gemm` (:func:`fp8_gemm`): float8_e4m3fn weights with float32 scales per output row and
  ``w_group_k`` input columns (per tensor / per channel: one group over K; DeepSeek's 128x128 blocks: 128).
  With float8 activations (W8A8, scales per token and ``x_group_k`` columns) the tile product is an fp8 x
  fp8 ``tl.dot`` (the tensor cores on Hopper) scaled per K step; with float activations (weight-only FP8) the
  weight tile is dequantised to x's dtype first.

The torch reference is services/engine/model/quant/formats.py's dequantisation followed by a matmul;
tests/unit/test_quant_triton.py holds these kernels to it under TRITON_INTERPRET=1 at toy sizes. Grid: one
program per (BLOCK_M, BLOCK_N) output tile, looping over K in BLOCK_K steps (BLOCK_K divides K and every
scale group along K).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int_gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, y_ptr, M, N, K,
                     stride_xm, stride_qk, stride_sg, stride_ym,
                     BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    per_word: tl.constexpr = 32 // BITS
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None], other=0.0)
        words = tl.load(q_ptr + (offs_k[:, None] // per_word) * stride_qk + offs_n[None, :], mask=mask_n[None, :],
                        other=0)
        q = (words >> ((offs_k[:, None] % per_word) * BITS)) & ((1 << BITS) - 1)
        g = tl.load(g_ptr + offs_k)[:, None]
        s = tl.load(s_ptr + g * stride_sg + offs_n[None, :], mask=mask_n[None, :], other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * stride_sg + offs_n[None, :], mask=mask_n[None, :], other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - z) * s  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, w.to(x.dtype))
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _nvfp4_gemm_kernel(x_ptr, p_ptr, s_ptr, r_ptr, y_ptr, M, N, K,
                       stride_xm, stride_pn, stride_sn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    row_mult = tl.load(r_ptr + offs_n, mask=mask_n, other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None], other=0.0)
        byte = tl.load(p_ptr + offs_n[None, :] * stride_pn + offs_k[:, None] // 2, mask=mask_n[None, :], other=0)
        code = (byte.to(tl.int32) >> ((offs_k[:, None] % 2) * 4)) & 0xF
        # e2m1: exponent bits 1-2, mantissa bit 0, sign bit 3; exponent 0 is subnormal (0 or 0.5)
        e = (code >> 1) & 3
        m = (code & 1).to(tl.float32)
        mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
        val = tl.where(code >= 8, -mag, mag)
        s = tl.load(s_ptr + offs_n[None, :] * stride_sn + offs_k[:, None] // 16, mask=mask_n[None, :], other=0.0)
        w = val * (s.to(tl.float32) * row_mult[None, :])
        acc += tl.dot(x, w.to(x.dtype))
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, y_ptr, M, N, K, x_group_k, w_group_k,
                     stride_xm, stride_wn, stride_xsm, stride_wsn, stride_ym,
                     X_IS_FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=mask_n[None, :], other=0.0)
        ws = tl.load(ws_ptr + offs_n * stride_wsn + k0 // w_group_k, mask=mask_n, other=0.0)
        if X_IS_FP8:
            xs = tl.load(xs_ptr + offs_m * stride_xsm + k0 // x_group_k, mask=mask_m, other=0.0)
            acc += tl.dot(x, w, out_dtype=tl.float32) * xs[:, None] * ws[None, :]
        else:
            acc += tl.dot(x, (w.to(tl.float32) * ws[None, :]).to(x.dtype))
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _check_k(k: int, block_k: int, multiple: int, what: str) -> None:
    if k % block_k or block_k % multiple:
        raise ValueError(f"{what}: K={k} must be a multiple of block_k={block_k}, itself a multiple of {multiple}")


def int_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
             g_idx: torch.Tensor, bits: int = 4, *, block_m: int = 16, block_n: int = 32,
             block_k: int = 32) -> torch.Tensor:
    """``x`` ``[M, K]`` @ the INT4/INT8 weight → ``[M, N]`` in x's dtype; ``scales`` and ``zeros`` (the unpacked
    zero points, as floats) ``[groups, N]``, ``g_idx`` int32 ``[K]``."""
    m, k = x.shape
    n = qweight.shape[1]
    _check_k(k, block_k, 32 // bits, "int_gemm")
    x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int_gemm_kernel[grid](x, qweight, scales.contiguous(), zeros.contiguous(), g_idx.int().contiguous(), y,
                           m, n, k, x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
                           BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              *, block_m: int = 16, block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """:func:`int_gemm` with 4 bits and contiguous groups of ``group_size`` input rows."""
    k = x.shape[1]
    _check_k(k, block_k, 8, "int4_gemm")
    g_idx = torch.arange(k, device=x.device, dtype=torch.int32) // group_size
    return int_gemm(x, qweight, scales, zeros, g_idx, 4, block_m=block_m, block_n=block_n, block_k=block_k)


def nvfp4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_mult: float | torch.Tensor,
               *, block_m: int = 16, block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """``x`` ``[M, K]`` @ the NVFP4 weight → ``[M, N]``; ``global_mult`` (a float, or float32 ``[N]`` per output
    row) multiplies every group scale (ModelOpt's weight_scale_2, or 1 / compressed-tensors' weight_global_scale)."""
    m, k = x.shape
    n = packed.shape[0]
    _check_k(k, block_k, 16, "nvfp4_gemm")
    x = x.contiguous()
    if not isinstance(global_mult, torch.Tensor):
        global_mult = torch.full((n,), float(global_mult), dtype=torch.float32, device=x.device)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _nvfp4_gemm_kernel[grid](x, packed, scale, global_mult.float().contiguous(), y, m, n, k, x.stride(0),
                             packed.stride(0), scale.stride(0), y.stride(0),
                             BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y


def fp8_scaled_gemm(x: torch.Tensor, x_scale: torch.Tensor | None, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                    out_dtype: torch.dtype, *, block_m: int = 16, block_n: int = 32,
                    block_k: int = 32) -> torch.Tensor:
    """``x`` ``[M, K]`` @ ``(w_fp8 * w_scale).T``: ``w_scale`` float32 ``[N, K / w_group_k]``. With ``x_scale``
    (``[M, K / x_group_k]``) ``x`` is float8_e4m3fn and stands for ``x * x_scale``; without it ``x`` is a float
    tensor multiplied as it is. Group widths come from the scales' shapes; ``block_k`` must divide each."""
    m, k = x.shape
    n = w_fp8.shape[0]
    w_group_k = k // w_scale.shape[1]
    x_group_k = k if x_scale is None else k // x_scale.shape[1]
    _check_k(k, block_k, 1, "fp8_scaled_gemm")
    if w_group_k % block_k or x_group_k % block_k:
        raise ValueError(f"fp8_scaled_gemm: block_k={block_k} must divide the scale groups "
                         f"(weight {w_group_k}, activation {x_group_k})")
    x = x.contiguous()
    w_scale = w_scale.float().contiguous()
    xs = w_scale if x_scale is None else x_scale.float().contiguous()  # unread without fp8 activations
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_gemm_kernel[grid](x, w_fp8.contiguous(), xs, w_scale, y, m, n, k, x_group_k, w_group_k,
                           x.stride(0), w_fp8.stride(0), xs.stride(0), w_scale.stride(0), y.stride(0),
                           X_IS_FP8=x_scale is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y


def fp8_gemm(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype = torch.float32, *, block_m: int = 16, block_n: int = 32,
             block_k: int = 32) -> torch.Tensor:
    """``(x_fp8 * x_scale) @ (w_fp8 * w_scale).T``: ``x_fp8`` ``[M, K]``, ``x_scale`` ``[M]`` (per token),
    ``w_fp8`` ``[N, K]``, ``w_scale`` ``[N]`` (per channel; expand a per-tensor scale)."""
    return fp8_scaled_gemm(x_fp8, x_scale.reshape(-1, 1), w_fp8, w_scale.reshape(-1, 1), out_dtype,
                           block_m=block_m, block_n=block_n, block_k=block_k)
