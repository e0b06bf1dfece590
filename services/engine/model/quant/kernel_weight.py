"""KernelWeight: a quantized linear layer's stored tensors in the layouts of the Triton GEMMs
(services/engine/kernels/quant_gemm.py), for the ``triton`` backend with ``--quant-dequant per-product``.

Built once at load from the layer's :class:`PackedPart` s (fused q/k/v or gate/up: several parts along the
output dimension) and moved to the model's device:
* AWQ / GPTQ / compressed-tensors ``pack-quantized``: the GPTQ layout ``qweight [K*bits/32, N]`` with
  float zero points and scales ``[groups, N]`` and ``g_idx [K]``; AWQ's columns are un-permuted and repacked
  along K, pack-quantized's rows transposed and repacked along K. Parts concatenate along N when their
  ``g_idx`` agree (always, without act order).
* NVFP4: ``packed [N, K/2]`` and ``scale [N, K/16]`` as stored; the global scale becomes a multiplier per
  output row, so parts with different global scales concatenate.
* FP8 (tensor / channel / block): ``weight [N, K]`` as stored, scales expanded to one row per output row
  ``[N, K / block_cols]`` (per tensor and per channel: one column); W8A8 layers quantize their input once in
  torch (:func:`fp8_quantize`: one scale per token, or per token and group) and the kernel multiplies fp8 by fp8.

Whatever a kernel cannot take (a K the tiles do not divide, mixed formats in one fused product) raises
ValueError at build; the loader then keeps the layer on the torch per-product path and says why.
:func:`build_expert_weights` stacks an MoE projection's experts the same way for the fused-MoE kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from services.engine.model.quant.formats import AWQ_REVERSE_ORDER, int_ct_codes, unpack_int32
from services.engine.model.quant.linear import PackedPart, fp8_quantize
from services.engine.model.quant.scheme import WeightFormat

if TYPE_CHECKING:
    from services.engine.kernels.fused_moe import ExpertWeights

_BLOCK_KS = (64, 32, 16)


class _Op(Protocol):
    out_features: int

    def matmul(self, x: torch.Tensor, x_fp8: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor: ...

    @property
    def num_bytes(self) -> int: ...


def _block_k(k: int, *groups: int) -> int:
    for b in _BLOCK_KS:
        if k % b == 0 and all(g % b == 0 for g in groups):
            return b
    raise ValueError(f"K={k} (scale groups {list(groups)}) is not a multiple of 16: no Triton tile fits")


def _tiles(m: int) -> tuple[int, int]:
    """(block_m, block_n): small M (decode) takes 16-row tiles."""
    return (16, 64) if m <= 16 else (64, 64)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[K, N]`` unsigned ``bits``-bit codes → int32 ``[K*bits/32, N]``, element j of a word at bit ``j*bits``
    (the GPTQ layout :func:`unpack_int32` reads)."""
    per_word = 32 // bits
    k, n = codes.shape
    v = codes.long().reshape(k // per_word, per_word, n)
    words = torch.zeros(k // per_word, n, dtype=torch.int64, device=codes.device)
    for j in range(per_word):
        words |= (v[:, j] & ((1 << bits) - 1)) << (bits * j)
    return (((words + 2**31) % 2**32) - 2**31).to(torch.int32)


@dataclass(frozen=True, kw_only=True)
class IntOp:
    qweight: torch.Tensor  # int32 [K*bits/32, N]
    scales: torch.Tensor  # [groups, N]
    zeros: torch.Tensor  # [groups, N], float
    g_idx: torch.Tensor  # int32 [K]
    bits: int

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def num_bytes(self) -> int:
        return _nbytes(self.qweight, self.scales, self.zeros, self.g_idx)

    def matmul(self, x: torch.Tensor, x_fp8: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        from services.engine.kernels.quant_gemm import int_gemm

        block_m, block_n = _tiles(x.shape[0])
        return int_gemm(x, self.qweight, self.scales, self.zeros, self.g_idx, self.bits, block_m=block_m,
                        block_n=block_n, block_k=_block_k(x.shape[1]))


@dataclass(frozen=True, kw_only=True)
class Nvfp4Op:
    packed: torch.Tensor  # uint8 [N, K/2]
    scale: torch.Tensor  # float8_e4m3fn [N, K/16]
    row_mult: torch.Tensor  # float32 [N]

    @property
    def out_features(self) -> int:
        return int(self.packed.shape[0])

    @property
    def num_bytes(self) -> int:
        return _nbytes(self.packed, self.scale, self.row_mult)

    def matmul(self, x: torch.Tensor, x_fp8: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        from services.engine.kernels.quant_gemm import nvfp4_gemm

        block_m, block_n = _tiles(x.shape[0])
        return nvfp4_gemm(x, self.packed, self.scale, self.row_mult, block_m=block_m, block_n=block_n,
                          block_k=_block_k(x.shape[1]))


@dataclass(frozen=True, kw_only=True)
class Fp8Op:
    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [N, K / group]

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def num_bytes(self) -> int:
        return _nbytes(self.weight, self.scale)

    def matmul(self, x: torch.Tensor, x_fp8: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        from services.engine.kernels.quant_gemm import fp8_scaled_gemm

        k = x.shape[1]
        block_m, block_n = _tiles(x.shape[0])
        groups = [k // self.scale.shape[1]]
        if x_fp8 is not None:
            groups.append(k // x_fp8[1].shape[1])
            return fp8_scaled_gemm(x_fp8[0], x_fp8[1], self.weight, self.scale, x.dtype, block_m=block_m,
                                   block_n=block_n, block_k=_block_k(k, *groups))
        return fp8_scaled_gemm(x, None, self.weight, self.scale, x.dtype, block_m=block_m, block_n=block_n,
                               block_k=_block_k(k, *groups))


@dataclass(frozen=True, kw_only=True)
class KernelWeight:
    """``ops``: products whose outputs concatenate along the last dimension (one when the parts merge)."""

    ops: tuple[IntOp | Nvfp4Op | Fp8Op, ...]
    act_group: int | None = None

    @property
    def num_bytes(self) -> int:
        return sum(op.num_bytes for op in self.ops)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, K]`` @ the layer's weight ``.T`` → ``[T, N]`` in x's dtype."""
        if x.shape[0] == 0:
            return x.new_empty((0, sum(op.out_features for op in self.ops)))
        x_fp8 = None if self.act_group is None else fp8_quantize(x, self.act_group)
        outs = [op.matmul(x, x_fp8) for op in self.ops]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def _int_op(part: PackedPart) -> IntOp:
    s, t = part.scheme, part.tensors
    n, k = part.shape
    fmt = s.format
    if fmt is WeightFormat.AWQ:
        def unpack(words: torch.Tensor) -> torch.Tensor:  # [r, N/8] AWQ order → [r, N]
            v = unpack_int32(words, 4, 1)
            return v.reshape(v.shape[0], -1, 8)[:, :, list(AWQ_REVERSE_ORDER)].reshape(v.shape[0], -1)

        qweight = pack_rows(unpack(t["qweight"]), 4)
        zeros = unpack(t["qzeros"]).to(t["scales"].dtype)
        g_idx = torch.arange(k, dtype=torch.int32, device=qweight.device) // (s.group_size or k)
        return IntOp(qweight=qweight, scales=t["scales"], zeros=zeros, g_idx=g_idx, bits=4)
    if fmt is WeightFormat.GPTQ:
        groups = t["scales"].shape[0]
        if s.symmetric:
            zeros = torch.full((groups, n), float(1 << (s.bits - 1)), dtype=t["scales"].dtype,
                               device=t["scales"].device)
        else:
            zeros = (unpack_int32(t["qzeros"], s.bits, 1) + s.zero_point_offset).to(t["scales"].dtype)
        return IntOp(qweight=t["qweight"], scales=t["scales"], zeros=zeros, g_idx=t["g_idx"].int(), bits=s.bits)
    if fmt is WeightFormat.INT_CT:
        if k % (32 // s.bits):
            raise ValueError(f"{part.prefix}: K={k} is not a multiple of {32 // s.bits} (one int32 word)")
        codes, zeros_ct, scales_ct, g_ct = int_ct_codes(s, t, part.prefix, n, k)
        return IntOp(qweight=pack_rows(codes.t(), s.bits), scales=scales_ct.t().contiguous(),
                     zeros=zeros_ct.t().float().contiguous(), g_idx=g_ct.int(), bits=s.bits)
    raise ValueError(f"{part.prefix}: no integer kernel layout for {fmt.value}")


def _part_op(part: PackedPart) -> IntOp | Nvfp4Op | Fp8Op:
    s, t = part.scheme, part.tensors
    n, k = part.shape
    fmt = s.format
    if fmt is WeightFormat.FP8:
        scale = t["weight_scale"].float()
        scale = scale.reshape(1, 1).expand(n, 1) if scale.numel() == 1 else scale.reshape(n, 1)
        return Fp8Op(weight=t["weight"], scale=scale.contiguous())
    if fmt is WeightFormat.FP8_BLOCK:
        assert s.block is not None
        rows, cols = s.block
        if k % cols:
            raise ValueError(f"{part.prefix}: K={k} is not a multiple of the FP8 block's {cols} columns")
        grid = t[s.scale_name].float()
        return Fp8Op(weight=t["weight"], scale=grid.repeat_interleave(rows, 0)[:n].contiguous())
    if fmt is WeightFormat.NVFP4_CT:
        mult = 1.0 / t["weight_global_scale"].float().reshape(())
        return Nvfp4Op(packed=t["weight_packed"], scale=t["weight_scale"], row_mult=mult.expand(n).contiguous())
    if fmt is WeightFormat.NVFP4_MODELOPT:
        mult = t["weight_scale_2"].float().reshape(())
        return Nvfp4Op(packed=t["weight"], scale=t["weight_scale"], row_mult=mult.expand(n).contiguous())
    return _int_op(part)


def _merge(a: IntOp | Nvfp4Op | Fp8Op, b: IntOp | Nvfp4Op | Fp8Op) -> IntOp | Nvfp4Op | Fp8Op | None:
    """``a`` and ``b`` as one product along N, or None when their layouts differ."""
    if isinstance(a, Fp8Op) and isinstance(b, Fp8Op) and a.scale.shape[1] == b.scale.shape[1]:
        return Fp8Op(weight=torch.cat((a.weight, b.weight)), scale=torch.cat((a.scale, b.scale)))
    if isinstance(a, Nvfp4Op) and isinstance(b, Nvfp4Op):
        return Nvfp4Op(packed=torch.cat((a.packed, b.packed)), scale=torch.cat((a.scale, b.scale)),
                       row_mult=torch.cat((a.row_mult, b.row_mult)))
    if (isinstance(a, IntOp) and isinstance(b, IntOp) and a.bits == b.bits and a.scales.shape[0] == b.scales.shape[0]
            and a.scales.dtype == b.scales.dtype and torch.equal(a.g_idx, b.g_idx)):
        return IntOp(qweight=torch.cat((a.qweight, b.qweight), 1), scales=torch.cat((a.scales, b.scales), 1),
                     zeros=torch.cat((a.zeros, b.zeros), 1), g_idx=a.g_idx, bits=a.bits)
    return None


def build_kernel_weight(parts: tuple[PackedPart, ...], act_group: int | None,
                        device: torch.device | str) -> KernelWeight:
    """The kernels' form of one (fused) layer, on ``device``; ValueError names what no kernel takes."""
    ops: list[IntOp | Nvfp4Op | Fp8Op] = []
    for part in parts:
        op = _part_op(part)
        if act_group is not None and not isinstance(op, Fp8Op):
            raise ValueError(f"{part.prefix}: dynamic FP8 activations with {part.scheme.format.value} weights")
        k = part.shape[1]
        _block_k(k, *([k // op.scale.shape[1]] if isinstance(op, Fp8Op) else []),
                 *([act_group or k] if act_group is not None else []))
        merged = _merge(ops[-1], op) if ops else None
        if merged is not None:
            ops[-1] = merged
        else:
            ops.append(op)
    moved = tuple(type(op)(**{f: (v.to(device) if isinstance(v, torch.Tensor) else v)  # type: ignore[arg-type]
                              for f, v in vars(op).items()}) for op in ops)
    return KernelWeight(ops=moved, act_group=act_group)


def build_expert_weights(experts: list[tuple[PackedPart, ...]], device: torch.device | str) -> ExpertWeights:
    """One MoE projection's experts (each: its parts, e.g. gate then up) stacked into the fused-MoE kernel's
    layout (kernels/fused_moe.py ExpertWeights) on ``device``; ValueError when the experts' layouts differ or
    no tile fits."""
    from services.engine.kernels.fused_moe import ExpertWeights

    ops: list[IntOp | Nvfp4Op | Fp8Op] = []
    for parts in experts:
        merged: IntOp | Nvfp4Op | Fp8Op | None = None
        for part in parts:
            op = _part_op(part)
            merged = op if merged is None else _merge(merged, op)
            if merged is None:
                raise ValueError(f"{part.prefix}: the expert's parts have different layouts")
        assert merged is not None
        ops.append(merged)
    kinds = {type(op) for op in ops}
    if len(kinds) != 1:
        raise ValueError(f"experts mix layouts: {sorted(k.__name__ for k in kinds)}")

    def stack(name: str) -> torch.Tensor:
        tensors = [getattr(op, name) for op in ops]
        if len({tuple(t.shape) for t in tensors}) != 1 or len({t.dtype for t in tensors}) != 1:
            raise ValueError(f"experts' {name} tensors differ in shape or dtype")
        return torch.stack(tensors).to(device)

    first = ops[0]
    if isinstance(first, Fp8Op):
        k = first.weight.shape[1]
        _block_k(k, k // first.scale.shape[1])
        return ExpertWeights(kind="fp8", weight=stack("weight"), scale=stack("scale"))
    if isinstance(first, Nvfp4Op):
        return ExpertWeights(kind="nvfp4", weight=stack("packed"), scale=stack("scale"), g_idx=stack("row_mult"))
    return ExpertWeights(kind="int", weight=stack("qweight"), scale=stack("scales"), zeros=stack("zeros"),
                         g_idx=stack("g_idx"), bits=first.bits)
