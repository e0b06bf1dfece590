"""Quantized GEMMs for CUDA that dequantise inside the tile: ``y [M, N] = x [M, K] @ W.T`` with W stored packed.

* :func:`int4_gemm`: weight-only INT4 in the GPTQ layout (``qweight`` int32 ``[K/8, N]``, element k of a word in
  bits 4k..4k+3; ``scales`` and float ``zeros`` ``[K/group, N]``); AWQ checkpoints reach it after their columns
  are reordered (formats.AWQ_REVERSE_ORDER) and transposed into this layout. Hopper has no INT4 MMA: the tile
  is dequantised to float32 in registers and multiplied on the float units.
* :func:`nvfp4_gemm`: weight-only NVFP4 (``packed`` uint8 ``[N, K/2]``, low nibble first; ``scale`` fp8 e4m3
  ``[N, K/16]``; one float multiplier for the global scale): Hopper has no FP4 MMA either.
* :func:`fp8_gemm`: float8_e4m3fn activations and weights with per-row (token) and per-column (channel)
  float32 scales, accumulated in float32 (on the tensor cores on a GPU).

The torch reference is services/engine/model/quant/formats.py's dequantisation followed by a float32 matmul;
tests/unit/test_quant_triton.py holds these kernels to it under TRITON_INTERPRET=1 at toy sizes. Grid: one
program per (BLOCK_M, BLOCK_N) output tile, looping over K in BLOCK_K steps (BLOCK_K divides the group).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int4_gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K, group_size,
                      stride_xm, stride_qk, stride_sg, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None], other=0.0)
        words = tl.load(q_ptr + (offs_k[:, None] // 8) * stride_qk + offs_n[None, :], mask=mask_n[None, :], other=0)
        q = (words >> ((offs_k[:, None] % 8) * 4)) & 0xF
        g = offs_k[:, None] // group_size
        s = tl.load(s_ptr + g * stride_sg + offs_n[None, :], mask=mask_n[None, :], other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * stride_sg + offs_n[None, :], mask=mask_n[None, :], other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - z) * s  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x.to(tl.float32), w)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _nvfp4_gemm_kernel(x_ptr, p_ptr, s_ptr, y_ptr, global_mult, M, N, K,
                       stride_xm, stride_pn, stride_sn, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
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
        w = val * (s.to(tl.float32) * global_mult)
        acc += tl.dot(x.to(tl.float32), w)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=mask_n[None, :], other=0.0)
        acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
    xs = tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)
    ws = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], (acc * xs[:, None] * ws[None, :]).to(
        y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _check_k(k: int, block_k: int, multiple: int, what: str) -> None:
    if k % block_k or block_k % multiple:
        raise ValueError(f"{what}: K={k} must be a multiple of block_k={block_k}, itself a multiple of {multiple}")


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              *, block_m: int = 16, block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """``x`` ``[M, K]`` @ the INT4 weight → ``[M, N]`` in x's dtype; ``zeros`` ``[K/group, N]`` float (the
    unpacked zero points), ``scales`` the same shape."""
    m, k = x.shape
    n = qweight.shape[1]
    _check_k(k, block_k, 8, "int4_gemm")
    if group_size % block_k:
        raise ValueError(f"int4_gemm: group_size {group_size} must be a multiple of block_k {block_k}")
    x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](x, qweight, scales.contiguous(), zeros.contiguous(), y, m, n, k, group_size,
                            x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y


def nvfp4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_mult: float,
               *, block_m: int = 16, block_n: int = 32, block_k: int = 32) -> torch.Tensor:
    """``x`` ``[M, K]`` @ the NVFP4 weight → ``[M, N]``; ``global_mult`` multiplies every group scale
    (ModelOpt's weight_scale_2, or 1 / compressed-tensors' weight_global_scale)."""
    m, k = x.shape
    n = packed.shape[0]
    _check_k(k, block_k, 16, "nvfp4_gemm")
    x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _nvfp4_gemm_kernel[grid](x, packed, scale, y, float(global_mult), m, n, k, x.stride(0), packed.stride(0),
                             scale.stride(0), y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y


def fp8_gemm(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype = torch.float32, *, block_m: int = 16, block_n: int = 32,
             block_k: int = 32) -> torch.Tensor:
    """``(x_fp8 * x_scale) @ (w_fp8 * w_scale).T``: ``x_fp8`` ``[M, K]``, ``x_scale`` ``[M]`` (per token),
    ``w_fp8`` ``[N, K]``, ``w_scale`` ``[N]`` (per channel; expand a per-tensor scale)."""
    m, k = x_fp8.shape
    n = w_fp8.shape[0]
    _check_k(k, block_k, 1, "fp8_gemm")
    y = torch.empty((m, n), dtype=out_dtype, device=x_fp8.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_gemm_kernel[grid](x_fp8.contiguous(), w_fp8.contiguous(), x_scale.float().contiguous(),
                           w_scale.float().contiguous(), y, m, n, k, x_fp8.stride(0), w_fp8.stride(0), y.stride(0),
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y
