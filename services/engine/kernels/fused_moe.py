"""Fused mixture-of-experts: every expert's GEMM of a step in one kernel launch (vLLM's fused_moe shape).

:func:`moe_align_block_size` sorts the ``T * top_k`` (token, slot) pairs by expert and pads each expert's run
to a multiple of ``BLOCK_M`` (padding entries hold ``T * top_k``, an index no pair has), so each block of
``BLOCK_M`` sorted pairs belongs to one expert (``expert_ids[block]``; ``-1`` past the last expert's run: the
buffers are sized for the worst case, so nothing waits on the device for the real size). The kernel runs one
program per (block, ``BLOCK_N`` output columns): it gathers the block's token rows of A, multiplies them by
its expert's weight, dequantised in the tile when it is quantized, optionally scales each row by its routing
weight, and scatters the rows to their pair's slot of C ``[T * top_k, N]``.

:func:`fused_moe`: gate_up (A = the tokens, row ``pair // top_k``), SiLU-and-mul, down (A = the pairs' rows,
routing weights applied), then the sum over each token's ``top_k`` slots.

Expert weight layouts (:class:`ExpertWeights`, ``kind``):
* ``dense``: ``weight [E, N, K]`` in the activation dtype (the MoE layer's own parameters).
* ``fp8``: float8_e4m3fn ``weight [E, N, K]``, float32 ``scale [E, N, K / group_k]`` (per tensor and per
  channel: one column), weight-only: the tile is dequantised to the activation dtype.
* ``int``: GPTQ-layout ``weight`` int32 ``[E, K * bits / 32, N]``, ``scale`` and float ``zeros``
  ``[E, groups, N]``, ``g_idx`` int32 ``[E, K]`` (AWQ repacked at load, as quant_gemm.int_gemm takes it).
* ``nvfp4``: uint8 ``weight [E, N, K / 2]``, fp8 ``scale [E, N, K / 16]``, float32 ``row_mult [E, N]`` (the
  global scale of each expert's part).

The torch reference is MoE.forward in model/model.py (one product pair per expert over its token group);
tests/unit/test_fused_moe.py holds this kernel to it under TRITON_INTERPRET=1 at toy sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

KINDS = ("dense", "fp8", "int", "nvfp4")


@dataclass(frozen=True, kw_only=True)
class ExpertWeights:
    kind: str
    weight: torch.Tensor
    scale: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None  # int: [E, K]; nvfp4: row_mult [E, N]
    bits: int = 4

    @property
    def num_experts(self) -> int:
        return int(self.weight.shape[0])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[2] if self.kind == "int" else self.weight.shape[1])

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale, self.zeros, self.g_idx)
                   if t is not None)


@triton.jit
def _fused_moe_kernel(a_ptr, b_ptr, s_ptr, z_ptr, g_ptr, c_ptr, tw_ptr, sorted_ptr, expert_ptr,
                      N, K, num_valid, top_k, group_k,
                      stride_am, stride_be, stride_b1, stride_b2, stride_se, stride_s1, stride_s2, stride_ge,
                      stride_cm,
                      QUANT: tl.constexpr, BITS: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(expert_ptr + pid_m)
    if expert < 0:
        return
    tok = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_t = tok < num_valid
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = tl.where(mask_t, tok // top_k, 0)
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :], mask=mask_t[:, None], other=0.0)
        if QUANT == 0:  # dense [E, N, K]
            w = tl.load(b_base + offs_n[None, :] * stride_b1 + offs_k[:, None] * stride_b2, mask=mask_n[None, :],
                        other=0.0).to(tl.float32)
        elif QUANT == 1:  # fp8 [E, N, K], scale [E, N, K / group_k]
            wq = tl.load(b_base + offs_n[None, :] * stride_b1 + offs_k[:, None] * stride_b2, mask=mask_n[None, :],
                         other=0.0)
            s = tl.load(s_ptr + expert * stride_se + offs_n * stride_s1 + (k0 // group_k) * stride_s2,
                        mask=mask_n, other=0.0)
            w = wq.to(tl.float32) * s[None, :]
        elif QUANT == 2:  # int: GPTQ layout [E, K * BITS / 32, N]
            per_word: tl.constexpr = 32 // BITS
            words = tl.load(b_base + (offs_k[:, None] // per_word) * stride_b1 + offs_n[None, :] * stride_b2,
                            mask=mask_n[None, :], other=0)
            q = (words >> ((offs_k[:, None] % per_word) * BITS)) & ((1 << BITS) - 1)
            g = tl.load(g_ptr + expert * stride_ge + offs_k)[:, None]
            s_off = expert * stride_se + g * stride_s1 + offs_n[None, :] * stride_s2
            s = tl.load(s_ptr + s_off, mask=mask_n[None, :], other=0.0).to(tl.float32)
            z = tl.load(z_ptr + s_off, mask=mask_n[None, :], other=0.0).to(tl.float32)
            w = (q.to(tl.float32) - z) * s
        else:  # nvfp4 [E, N, K / 2], scale [E, N, K / 16], row_mult [E, N]
            byte = tl.load(b_base + offs_n[None, :] * stride_b1 + (offs_k[:, None] // 2) * stride_b2,
                           mask=mask_n[None, :], other=0)
            code = (byte.to(tl.int32) >> ((offs_k[:, None] % 2) * 4)) & 0xF
            e = (code >> 1) & 3
            m = (code & 1).to(tl.float32)
            mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
            val = tl.where(code >= 8, -mag, mag)
            s = tl.load(s_ptr + expert * stride_se + offs_n[None, :] * stride_s1 + (offs_k[:, None] // 16) * stride_s2,
                        mask=mask_n[None, :], other=0.0).to(tl.float32)
            r = tl.load(g_ptr + expert * stride_ge + offs_n, mask=mask_n, other=0.0)
            w = val * s * r[None, :]
        acc += tl.dot(a, w.to(a.dtype))
    if MUL_ROUTED_WEIGHT:
        tw = tl.load(tw_ptr + tok, mask=mask_t, other=0.0).to(tl.float32)
        acc = acc * tw[:, None]
    tl.store(c_ptr + tok[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mask_t[:, None] & mask_n[None, :])


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_ids`` ``[T, k]`` → (``sorted_ids`` int32 ``[num_blocks * block_m]``: pair indices ``t * k + j``
    grouped by expert, each group padded to a multiple of ``block_m`` with ``T * k``; ``expert_ids`` int32
    ``[num_blocks]``: each block's expert, ``-1`` for the unused tail). Sized for the worst case
    (``T * k + E * (block_m - 1)`` entries) so no device value is read on the host."""
    flat = topk_ids.flatten().long()
    num_pairs = flat.numel()
    device = flat.device
    num_blocks = -(-(num_pairs + num_experts * (block_m - 1)) // block_m)
    # scatter_add, not bincount: bincount reads its maximum on the host (no CUDA-graph capture)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=device) - first_of_expert[sorted_experts]
    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[starts[sorted_experts] + rank] = order.int()
    block_start = torch.arange(num_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(ends, block_start, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).int()
    return sorted_ids, expert_ids


def _block_k(k: int, w: ExpertWeights) -> int:
    groups = [k // w.scale.shape[2]] if w.kind == "fp8" and w.scale is not None else []
    for b in (64, 32, 16):
        if k % b == 0 and all(g % b == 0 for g in groups):
            return b
    raise ValueError(f"fused_moe: K={k} (scale groups {groups}) is not a multiple of 16")


def moe_gemm(a: torch.Tensor, w: ExpertWeights, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
             num_pairs: int, top_k: int, block_m: int, topk_weights: torch.Tensor | None = None) -> torch.Tensor:
    """C ``[num_pairs, N]``: row p = A[p // top_k] @ W[expert of p].T (times p's routing weight when given)."""
    k = a.shape[1]
    n = w.out_features
    c = torch.zeros((num_pairs, n), dtype=a.dtype, device=a.device)
    if num_pairs == 0:
        return c
    b = w.weight
    s = w.scale if w.scale is not None else b
    z = w.zeros if w.zeros is not None else s
    g = w.g_idx if w.g_idx is not None else s
    if w.kind not in KINDS:
        raise ValueError(f"fused_moe: unknown expert weight kind {w.kind!r} (known: {', '.join(KINDS)})")
    strides_b = (b.stride(0), b.stride(1), b.stride(2))
    strides_s = (s.stride(0), s.stride(1), s.stride(2)) if s.dim() == 3 else (0, 0, 0)
    group_k = k // s.shape[2] if w.kind == "fp8" else 1
    block_n = 64
    tw = topk_weights.flatten().contiguous() if topk_weights is not None else c
    grid = (expert_ids.numel(), triton.cdiv(n, block_n))
    _fused_moe_kernel[grid](a.contiguous(), b, s, z, g, c, tw, sorted_ids, expert_ids, n, k, num_pairs, top_k,
                            group_k, a.stride(0), *strides_b, *strides_s, g.stride(0), c.stride(0),
                            QUANT=KINDS.index(w.kind), BITS=w.bits, MUL_ROUTED_WEIGHT=topk_weights is not None,
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_block_k(k, w))
    return c


def fused_moe(x: torch.Tensor, gate_up: ExpertWeights, down: ExpertWeights, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed experts' SwiGLU of ``x`` ``[T, H]``: ``sum_j w[t, j] * down_e(silu(gate_e(x)) * up_e(x))`` with
    ``e = topk_ids[t, j]``; ``gate_up`` ``[E, 2I, H]`` (gate rows first), ``down`` ``[E, H, I]``."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    block_m = 16 if num_pairs <= 16 * gate_up.num_experts else 64
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, block_m, gate_up.num_experts)
    h = moe_gemm(x, gate_up, sorted_ids, expert_ids, num_pairs, top_k, block_m)
    gate, up = h.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    y = moe_gemm(act, down, sorted_ids, expert_ids, num_pairs, 1, block_m, topk_weights.to(x.dtype))
    return y.view(num_tokens, top_k, down.out_features).sum(dim=1)
