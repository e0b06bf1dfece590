"""RMSNorm as one Triton program per row, optionally fused with the residual add before it.

Numerics match ``reference.rms_norm`` (model.py's order): the sum of squares and the normalisation run in
float32, the normalised row is rounded to the activation dtype, then multiplied by the weight and rounded
again, so in bf16/fp16 the only difference from torch is the order of the float32 sum. The fused variant
rounds ``x + residual`` to the activation dtype first, writes it back into ``residual`` (the new residual
stream), and normalises that rounded sum, exactly as ``x = x + sublayer(x); rms_norm(x)`` does.

Rows may be strided: a 3-D ``[T, H, D]`` view (Qwen3's per-head q/k norm on a slice of the fused qkv
output) is addressed as row ``r = t * H + h`` with the tensor's own two leading strides, so no copy is
made. The last dim must be contiguous. Any width works: the row is one block of the next power of two,
masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x_outer,
    stride_x_inner,
    stride_residual,
    stride_out_outer,
    stride_out_inner,
    inner_count,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    outer = row // inner_count
    inner = row % inner_count
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + outer * stride_x_outer + inner * stride_x_inner + cols, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
        total = (x + residual).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_residual + cols, total, mask=mask)
        x = total.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = (weight * normed).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + outer * stride_out_outer + inner * stride_out_inner + cols, out, mask=mask)


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_rows, inner_count, outer stride, inner stride) of a 2-D or 3-D tensor with a contiguous last dim."""
    if x.stride(-1) != 1:
        raise ValueError("the last dim must be contiguous")
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)
    raise ValueError(f"expected a 2-D or 3-D tensor, got shape {tuple(x.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dim of ``x`` (2-D or 3-D); a new contiguous tensor of x's dtype."""
    num_rows, inner_count, stride_outer, stride_inner = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _, _, out_outer, out_inner = _rows(out)
    n_cols = x.shape[-1]
    if num_rows == 0:
        return out
    _rms_norm_kernel[(num_rows,)](
        x, x, weight, out,
        stride_outer, stride_inner, 0, out_outer, out_inner, inner_count, n_cols, eps,
        HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(n_cols),
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` (in place, rounded to residual's dtype), then return ``(rms_norm(residual), residual)``.

    ``x`` and ``residual`` are ``[T, N]`` with a contiguous last dim; ``residual`` must not alias ``x``.
    """
    if x.dim() != 2 or residual.shape != x.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must be the same 2-D shape")
    if residual.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("the last dim must be contiguous")
    out = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
    num_rows, n_cols = x.shape
    if num_rows == 0:
        return out, residual
    _rms_norm_kernel[(num_rows,)](
        x, residual, weight, out,
        x.stride(0), 0, residual.stride(0), out.stride(0), 0, 1, n_cols, eps,
        HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(n_cols),
    )
    return out, residual
