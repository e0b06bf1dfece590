"""SiLU-and-mul (SwiGLU's gate): ``silu(gate) * up`` for ``x = cat(gate, up)`` along the last dim.

Numerics match model.py's ``F.silu(gate) * up``: silu computed in float32 and rounded to the activation
dtype, then the product rounded again. Grid: one program per (row, column block); any width, masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x_row, stride_out_row, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out_row + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, block: int = 1024) -> torch.Tensor:
    """``x`` ``[T, 2I]`` (contiguous last dim) -> ``[T, I]`` in x's dtype."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"expected [T, 2I] with a contiguous last dim, got {tuple(x.shape)}")
    num_rows, n_cols = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_rows, n_cols), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    block = min(block, triton.next_power_of_2(n_cols))
    _silu_and_mul_kernel[(num_rows, triton.cdiv(n_cols, block))](
        x, out, x.stride(0), out.stride(0), n_cols, BLOCK=block
    )
    return out
