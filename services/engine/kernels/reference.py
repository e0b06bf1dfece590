"""Torch references for the elementwise kernels: the oracles the Triton kernels are tested against.

Numerics follow ``services/engine/model/model.py`` (itself transformers' eager order): RMSNorm computes in
float32 and casts the normalised value back before the weight multiply; the residual add happens in the
activation dtype; SiLU rounds to the activation dtype before the multiply. RoPE is the neox layout
(rotate the two halves of each head) computed in float32 from a float32 cos/sin cache and rounded once,
which is slightly *more* exact than model.py's bf16 products; the tests hold both to a per-dtype tolerance.

The attention kernels' oracle is the engine's own ``TorchPagedAttention`` and ``KVCache.write``; the
functions here are for the ops model.py computes inline.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` over the last dim; model.py's ``rms_norm``, written out."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)``: the decoder layer's ``x = x + sublayer(x)`` followed by
    the next norm. The sum is rounded to the activation dtype first, as model.py's ``x + ...`` does."""
    total = residual + x
    return rms_norm(total, weight, eps), total


def rope_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[max_positions, head_dim / 2]`` float32 for positions ``0 .. max_positions - 1``, the
    same products model.py forms per step (``positions.float() * inv_freq``), so the values are identical."""
    freqs = torch.arange(max_positions, device=inv_freq.device).float()[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def rope(
    x: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor
) -> torch.Tensor:
    """Neox rotary embedding of ``x`` ``[T, H, D]`` at ``positions`` ``[T]``: with ``x = (x1, x2)`` the two
    halves of a head, ``(x1 cos - x2 sin, x2 cos + x1 sin)`` in float32, rounded to x's dtype once."""
    cos = cos_cache[positions].float()[:, None, :]
    sin = sin_cache[positions].float()[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = cat(gate, up)`` along the last dim (model.py's MLP)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
