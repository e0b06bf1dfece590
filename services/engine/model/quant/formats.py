"""Dequantisation of one linear layer's stored tensors into a dense ``[out, in]`` float32 weight.

Each function reads exactly the tensors the ecosystem's exporters write under the layer's prefix (names,
dtypes and packing in docs/quantization.md) and is the torch reference every faster path (per-product
dequantisation, the Triton kernels) is held to. Float32 throughout: the result is cast to the compute dtype
by the caller, once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.engine.model.quant.scheme import WeightFormat, WeightScheme

Getter = Callable[[str], torch.Tensor]

# e2m1 code (low 3 bits: exponent 2, mantissa 1) → magnitude; bit 3 is the sign (OCP MX spec, NVFP4).
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# AWQ's GEMM kernel packs eight 4-bit columns into an int32 in the order 0 2 4 6 1 3 5 7 (AutoAWQ
# pack_intweight / vLLM awq_triton): nibble j of a word holds column AWQ_ORDER[j]; this undoes it.
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def stored_tensors(scheme: WeightScheme, prefix: str) -> tuple[str, ...]:
    """The tensor names (under ``prefix.``) a layer stored in ``scheme`` must have."""
    names = {
        WeightFormat.FP8: ("weight", "weight_scale"),
        WeightFormat.FP8_BLOCK: ("weight", scheme.scale_name),
        WeightFormat.NVFP4_CT: ("weight_packed", "weight_scale", "weight_global_scale"),
        WeightFormat.NVFP4_MODELOPT: ("weight", "weight_scale", "weight_scale_2"),
        WeightFormat.AWQ: ("qweight", "qzeros", "scales"),
        WeightFormat.GPTQ: ("qweight", "qzeros", "scales", "g_idx"),
        WeightFormat.INT_CT: ("weight_packed", "weight_scale", "weight_shape",
                              *(() if scheme.symmetric else ("weight_zero_point",)),
                              *(("weight_g_idx",) if scheme.act_order else ())),
    }[scheme.format]
    return tuple(f"{prefix}.{n}" for n in names)


def dequantize(scheme: WeightScheme, get: Getter, prefix: str, shape: tuple[int, int]) -> torch.Tensor:
    """The ``[out, in]`` float32 weight of layer ``prefix`` (``get(name)`` reads a stored tensor). A stored
    tensor of the wrong shape or dtype raises ValueError naming it (the loader words it as a ModelLoadError)."""
    out_features, in_features = shape
    t = {name.rsplit(".", 1)[1]: get(name) for name in stored_tensors(scheme, prefix)}
    fmt = scheme.format
    if fmt is WeightFormat.FP8:
        weight = _expect(t["weight"], prefix, "weight", (out_features, in_features), torch.float8_e4m3fn)
        scale = t["weight_scale"].float()
        if scale.numel() == 1:
            return weight.float() * scale.reshape(())
        _expect(scale, prefix, "weight_scale", (out_features, 1))
        return weight.float() * scale
    if fmt is WeightFormat.FP8_BLOCK:
        assert scheme.block is not None
        rows, cols = scheme.block
        weight = _expect(t["weight"], prefix, "weight", (out_features, in_features), torch.float8_e4m3fn)
        grid = (-(-out_features // rows), -(-in_features // cols))
        scale = _expect(t[scheme.scale_name], prefix, scheme.scale_name, grid).float()
        full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:out_features, :in_features]
        return weight.float() * full
    if fmt in (WeightFormat.NVFP4_CT, WeightFormat.NVFP4_MODELOPT):
        packed_name = "weight_packed" if fmt is WeightFormat.NVFP4_CT else "weight"
        packed = _expect(t[packed_name], prefix, packed_name, (out_features, in_features // 2), torch.uint8)
        scale = _expect(t["weight_scale"], prefix, "weight_scale", (out_features, in_features // 16),
                        torch.float8_e4m3fn).float()
        values = unpack_e2m1(packed)
        if fmt is WeightFormat.NVFP4_CT:
            # compressed-tensors stores the global scale as a divisor (FP8_MAX * FP4_MAX / amax).
            group_scale = scale / t["weight_global_scale"].float().reshape(())
        else:
            # ModelOpt stores weight_scale_2 = amax / (FP8_MAX * FP4_MAX), a multiplier.
            group_scale = scale * t["weight_scale_2"].float().reshape(())
        return values * group_scale.repeat_interleave(16, 1)
    if fmt is WeightFormat.AWQ:
        return _awq(scheme, t, prefix, out_features, in_features)
    if fmt is WeightFormat.INT_CT:
        codes, zeros, scales, g_idx = int_ct_codes(scheme, t, prefix, out_features, in_features)
        return (codes - zeros[:, g_idx]).float() * scales[:, g_idx]
    return _gptq(scheme, t, prefix, out_features, in_features)


def _expect(tensor: torch.Tensor, prefix: str, leaf: str, shape: tuple[int, ...],
            dtype: torch.dtype | None = None) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"tensor '{prefix}.{leaf}' has shape {tuple(tensor.shape)}, expected {shape}")
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"tensor '{prefix}.{leaf}' has dtype {tensor.dtype}, expected {dtype}")
    return tensor


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., n/2]`` → float32 ``[..., n]``: element 2i is the low nibble of byte i (compressed-tensors
    pack_fp4_to_uint8, ModelOpt, vLLM's cutlass layout agree)."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1).long()
    magnitude = E2M1_VALUES.to(packed.device)[codes & 7]
    return torch.where(codes >= 8, -magnitude, magnitude)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words → unsigned ``bits``-bit integers (int32), element k of a word in bits ``[k*bits, (k+1)*bits)``
    (GPTQ order), unpacked along ``dim`` (the packed dimension grows ``32 // bits`` times)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    moved = packed.movedim(dim, -1)
    values = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(*moved.shape[:-1], moved.shape[-1] * per_word).movedim(-1, dim)


def _group_index(in_features: int, group_size: int, device: torch.device | None = None) -> torch.Tensor:
    return torch.arange(in_features, device=device) // (group_size or in_features)


def _awq(scheme: WeightScheme, t: dict[str, torch.Tensor], prefix: str, out_features: int,
         in_features: int) -> torch.Tensor:
    """AutoAWQ GEMM: qweight ``[in, out/8]``, qzeros ``[groups, out/8]`` (AWQ nibble order), scales
    ``[groups, out]``; ``w[in, out] = (q - zero) * scale``, transposed to ``[out, in]``."""
    num_groups = in_features // (scheme.group_size or in_features)
    qweight = _expect(t["qweight"], prefix, "qweight", (in_features, out_features // 8), torch.int32)
    qzeros = _expect(t["qzeros"], prefix, "qzeros", (num_groups, out_features // 8), torch.int32)
    scales = _expect(t["scales"], prefix, "scales", (num_groups, out_features)).float()
    order = list(AWQ_REVERSE_ORDER)

    def unpack(words: torch.Tensor) -> torch.Tensor:
        values = unpack_int32(words, 4, 1)
        return values.reshape(values.shape[0], -1, 8)[:, :, order].reshape(values.shape[0], -1)

    groups = _group_index(in_features, scheme.group_size, qweight.device)
    w = (unpack(qweight) - unpack(qzeros)[groups]).float() * scales[groups]
    return w.t().contiguous()


def int_ct_codes(scheme: WeightScheme, t: dict[str, torch.Tensor], prefix: str, out_features: int,
                 in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors ``pack-quantized`` (pack_to_int32): ``weight_packed`` int32 ``[out, ceil(in*bits/32)]``,
    input column k in word ``k // (32/bits)`` at bit ``(k % (32/bits)) * bits``, each value stored plus
    ``2^(bits-1)`` (signed int8 → unsigned); ``weight_scale`` ``[out, groups]`` (channel: one group);
    ``weight_zero_point`` (asymmetric only) int32 ``[ceil(out*bits/32), groups]``, packed the same way along the
    output dimension; ``weight_g_idx`` ``[in]`` with actorder group; ``weight_shape`` ``[out, in]``.
    ``w = (q - zero_point) * scale``, both signed or, as returned here, both offset: unsigned codes ``[out, in]``,
    zero points ``[out, groups]`` (int32), scales ``[out, groups]`` (float32) and each column's group ``[in]``."""
    bits = scheme.bits
    per_word = 32 // bits
    group = scheme.group_size or in_features
    num_groups = -(-in_features // group)
    shape = t["weight_shape"]
    if shape.dtype.is_floating_point or tuple(int(v) for v in shape.flatten()) != (out_features, in_features):
        raise ValueError(f"tensor '{prefix}.weight_shape' is {shape.tolist()}, expected [{out_features}, "
                         f"{in_features}]")
    packed = _expect(t["weight_packed"], prefix, "weight_packed", (out_features, -(-in_features // per_word)),
                     torch.int32)
    scales = _expect(t["weight_scale"], prefix, "weight_scale", (out_features, num_groups)).float()
    codes = unpack_int32(packed, bits, 1)[:, :in_features]
    offset = 1 << (bits - 1)
    if scheme.symmetric:
        zeros = torch.full((out_features, num_groups), offset, dtype=torch.int32, device=packed.device)
    else:
        zp = _expect(t["weight_zero_point"], prefix, "weight_zero_point",
                     (-(-out_features // per_word), num_groups), torch.int32)
        zeros = unpack_int32(zp, bits, 0)[:out_features]
    if scheme.act_order:
        g_idx = _expect(t["weight_g_idx"], prefix, "weight_g_idx", (in_features,)).long()
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups):
            raise ValueError(f"tensor '{prefix}.weight_g_idx' names a group outside 0..{num_groups - 1}")
    else:
        g_idx = _group_index(in_features, group, packed.device)
    return codes, zeros, scales, g_idx


def _gptq(scheme: WeightScheme, t: dict[str, torch.Tensor], prefix: str, out_features: int,
          in_features: int) -> torch.Tensor:
    """AutoGPTQ: qweight ``[in*bits/32, out]`` (packed along the input), qzeros ``[groups, out*bits/32]``
    (packed along the output; the v1 format stores zero - 1), scales ``[groups, out]``, g_idx ``[in]`` (each
    input column's group: with desc_act the columns' order of quantisation, not ``i // group_size``)."""
    bits = scheme.bits
    per_word = 32 // bits
    num_groups = in_features // (scheme.group_size or in_features)
    qweight = _expect(t["qweight"], prefix, "qweight", (in_features // per_word, out_features), torch.int32)
    qzeros = _expect(t["qzeros"], prefix, "qzeros", (num_groups, out_features // per_word), torch.int32)
    scales = _expect(t["scales"], prefix, "scales", (num_groups, out_features)).float()
    g_idx = _expect(t["g_idx"], prefix, "g_idx", (in_features,)).long()
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups):
        raise ValueError(f"tensor '{prefix}.g_idx' names a group outside 0..{num_groups - 1}")
    q = unpack_int32(qweight, bits, 0)
    if scheme.symmetric:
        # AutoGPTQ writes the midpoint 2^(bits-1) (minus the v1 offset) as every zero point when sym
        zeros = torch.full((num_groups, out_features), 1 << (bits - 1), dtype=torch.int32, device=qweight.device)
    else:
        zeros = unpack_int32(qzeros, bits, 1) + scheme.zero_point_offset
    w = (q - zeros[g_idx]).float() * scales[g_idx]
    return w.t().contiguous()
