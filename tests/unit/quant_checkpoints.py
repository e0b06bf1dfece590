"""Test-side quantizers: turn a tiny dense checkpoint into the exact on-disk layout each exporter writes
(compressed-tensors / llm-compressor, transformers FineGrainedFP8, ModelOpt, AutoAWQ, AutoGPTQ), plus a dense
float32 twin holding the weights those files decode to.

The decoded weights are computed here from the integer codes and scales the quantizer chose, with the
exporters' formulas written out independently of services/engine/model/quant (packing order included), so a
wrong unpacking in the engine shows up as a logit difference against the twin.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
LINEAR_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")

Quantizer = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words holding 32-bit patterns → int32 with the same bits (two's complement)."""
    return (((words + 2**31) % 2**32) - 2**31).to(torch.int32)


def fp8_tensor(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    scale = (w.abs().max() / FP8_MAX).reshape(1)
    q = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def fp8_channel(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    scale = w.abs().amax(1, keepdim=True) / FP8_MAX
    q = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def fp8_block(block: int, scale_name: str) -> Quantizer:
    def quantize(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        rows, cols = w.shape
        grid = torch.zeros(-(-rows // block), -(-cols // block))
        decoded = torch.zeros_like(w)
        q = torch.zeros_like(w).to(torch.float8_e4m3fn)
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
                s = tile.abs().max() / FP8_MAX
                grid[i, j] = s
                qt = (tile / s).to(torch.float8_e4m3fn)
                q[i * block:(i + 1) * block, j * block:(j + 1) * block] = qt
                decoded[i * block:(i + 1) * block, j * block:(j + 1) * block] = qt.float() * s
        return {"weight": q, scale_name: grid}, decoded
    return quantize


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (sign in bit 3) of every element of ``x`` (already divided by its scale)."""
    magnitude = (x.abs().unsqueeze(-1) - E2M1).abs().argmin(-1)
    return torch.where(x < 0, magnitude + 8, magnitude)


def _e2m1_value(codes: torch.Tensor) -> torch.Tensor:
    v = E2M1[codes & 7]
    return torch.where(codes >= 8, -v, v)


def nvfp4(layout: str) -> Quantizer:
    """``layout`` "ct" (compressed-tensors nvfp4-pack-quantized) or "modelopt"."""
    def quantize(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        rows, cols = w.shape
        groups = w.reshape(rows, cols // 16, 16)
        amax = w.abs().max()
        global_scale = FP8_MAX * 6.0 / amax  # compressed-tensors: a divisor; ModelOpt's weight_scale_2 is 1/it
        local = (groups.abs().amax(-1) / 6.0 * global_scale).to(torch.float8_e4m3fn)  # [rows, cols/16]
        effective = local.float() / global_scale
        codes = _e2m1_codes(groups / effective.unsqueeze(-1)).reshape(rows, cols)
        decoded = _e2m1_value(codes).reshape(rows, cols // 16, 16) * effective.unsqueeze(-1)
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
        if layout == "ct":
            tensors = {"weight_packed": packed, "weight_scale": local,
                       "weight_global_scale": global_scale.reshape(1).float()}
        else:
            tensors = {"weight": packed, "weight_scale": local, "weight_scale_2": (1.0 / global_scale).reshape(())}
        return tensors, decoded.reshape(rows, cols)
    return quantize


def _minmax_int4(w_t: torch.Tensor, group: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w_t`` ``[in, out]`` → codes ``[in, out]`` (0..15), scales ``[groups, out]`` (fp16), zeros ``[groups, out]``."""
    k, n = w_t.shape
    g = w_t.reshape(k // group, group, n)
    if sym:
        xmax = g.abs().amax(1)
        scale = (2 * xmax / 15).half().float()
        zero = torch.full_like(scale, 8)
    else:
        lo, hi = g.amin(1), g.amax(1)
        scale = ((hi - lo) / 15).half().float()
        zero = torch.round(-lo / scale).clamp(1, 15)  # >= 1: the GPTQ v1 format cannot store zero 0 (zero - 1)
    codes = torch.clamp(torch.round(g / scale[:, None]) + zero[:, None], 0, 15).reshape(k, n)
    return codes.long(), scale, zero.long()


def awq(group: int) -> Quantizer:
    order = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order for the GEMM kernel

    def pack(values: torch.Tensor) -> torch.Tensor:  # [r, c] 0..15 → [r, c/8] int32, AWQ order
        r, c = values.shape
        words = torch.zeros(r, c // 8, dtype=torch.int64)
        for i, col in enumerate(order):
            words |= values[:, col::8] << (4 * i)
        return _as_int32(words)

    def quantize(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        codes, scale, zero = _minmax_int4(w.t(), group, sym=False)
        rows = torch.arange(w.shape[1]) // group
        decoded = ((codes - zero[rows]).float() * scale[rows]).t()
        return {"qweight": pack(codes), "qzeros": pack(zero), "scales": scale.half()}, decoded
    return quantize


def gptq(group: int, *, sym: bool, desc_act: bool = False, seed: int = 0) -> Quantizer:
    def pack_rows(values: torch.Tensor) -> torch.Tensor:  # [r, c] → [r/8, c], element k of a word at 4k
        r, c = values.shape
        v = values.reshape(r // 8, 8, c)
        words = torch.zeros(r // 8, c, dtype=torch.int64)
        for k in range(8):
            words |= (v[:, k] & 0xF) << (4 * k)
        return _as_int32(words)

    def quantize(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        k = w.shape[1]
        if desc_act:
            # act-order: columns quantized in a permuted order, group i holds the i-th run of that order
            perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perm] = torch.arange(k) // group
        else:
            g_idx = torch.arange(k) // group
        w_t = w.t()
        # group the columns by g_idx, quantize each group as a block, scatter back
        order = torch.argsort(g_idx, stable=True)
        codes_sorted, scale, zero = _minmax_int4(w_t[order], group, sym=sym)
        codes = torch.empty_like(codes_sorted)
        codes[order] = codes_sorted
        decoded = ((codes - zero[g_idx]).float() * scale[g_idx]).t()
        qzeros = pack_rows((zero - 1).t().contiguous()).t().contiguous()  # v1: zero - 1, packed along out
        return {"qweight": pack_rows(codes), "qzeros": qzeros, "scales": scale.half(),
                "g_idx": g_idx.to(torch.int32)}, decoded
    return quantize


def quantize_checkpoint(dense: Path, out: Path, twin: Path, quantizer: Quantizer,
                        quantization_config: dict[str, object] | None, *, skip: Callable[[str], bool] = lambda _: False,
                        hf_quant_config: dict[str, object] | None = None) -> None:
    """Write ``out`` (``dense`` with every linear layer but lm_head quantized by ``quantizer``, config.json
    carrying ``quantization_config``) and ``twin`` (dense float32, the weights ``out`` decodes to)."""
    for d in (out, twin):
        shutil.copytree(dense, d)
    tensors = load_file(str(dense / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    decoded: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in LINEAR_LEAVES and not skip(module):
            stored, dec = quantizer(t.float())
            quantized.update({f"{module}.{k}": v.contiguous() for k, v in stored.items()})
            decoded[name] = dec.float().contiguous()
        else:
            quantized[name] = t
            decoded[name] = t
    save_file(quantized, str(out / "model.safetensors"), metadata={"format": "pt"})
    save_file(decoded, str(twin / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if hf_quant_config is not None:
        (out / "hf_quant_config.json").write_text(json.dumps(hf_quant_config, indent=2))


def ct_config(fmt: str, weights: dict[str, object], input_activations: dict[str, object] | None = None
              ) -> dict[str, object]:
    """A compressed-tensors quantization_config as llm-compressor writes it (one group, lm_head ignored)."""
    return {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "global_compression_ratio": None, "kv_cache_scheme": None, "sparsity_config": {},
        "ignore": ["lm_head"], "version": "0.20.0",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "format": fmt, "output_activations": None,
            "weights": {"symmetric": True, "dynamic": False, "actorder": None, "observer": "minmax",
                        "observer_kwargs": {}, **weights},
            "input_activations": input_activations,
        }},
    }


def ct_pack(bits: int, group: int, *, sym: bool, actorder: bool = False, seed: int = 0) -> Quantizer:
    """compressed-tensors ``pack-quantized`` as llm-compressor writes it (compressed_tensors pack_to_int32):
    signed codes ``q`` in ``[-2^(b-1), 2^(b-1) - 1]`` stored plus ``2^(b-1)``, packed along the input
    (``weight_packed [out, in*b/32]``); ``weight_scale [out, groups]`` fp16 (``group`` 0: channel); asymmetric
    zero points (signed) packed along the output (``weight_zero_point [out*b/32, groups]``); ``weight_shape``;
    with ``actorder`` the groups follow a permutation of the columns and ``weight_g_idx`` names each one's."""
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    per_word = 32 // bits

    def pack(unsigned: torch.Tensor) -> torch.Tensor:  # [r, c] → [r, c / per_word], element j at bit j*bits
        r, c = unsigned.shape
        v = unsigned.long().reshape(r, c // per_word, per_word)
        words = torch.zeros(r, c // per_word, dtype=torch.int64)
        for j in range(per_word):
            words |= v[:, :, j] << (bits * j)
        return _as_int32(words)

    def quantize(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        out, k = w.shape
        g = group or k
        if actorder:
            perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perm] = torch.arange(k) // g
        else:
            g_idx = torch.arange(k) // g
        num_groups = k // g
        scale = torch.zeros(out, num_groups)
        zero = torch.zeros(out, num_groups)
        for i in range(num_groups):
            cols = w[:, g_idx == i]
            if sym:
                scale[:, i] = cols.abs().amax(1) / ((qmax - qmin) / 2)
            else:
                lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
                scale[:, i] = (hi - lo) / (qmax - qmin)
                zero[:, i] = torch.clamp(torch.round(qmin - lo / scale[:, i]), qmin, qmax)
        scale = scale.half().float()
        q = torch.clamp(torch.round(w / scale[:, g_idx]) + zero[:, g_idx], qmin, qmax)
        decoded = (q - zero[:, g_idx]) * scale[:, g_idx]
        tensors = {"weight_packed": pack((q - qmin).long()), "weight_scale": scale.half(),
                   "weight_shape": torch.tensor([out, k])}
        if not sym:
            tensors["weight_zero_point"] = pack((zero - qmin).long().t().contiguous()).t().contiguous()
        if actorder:
            tensors["weight_g_idx"] = g_idx.to(torch.int32)
        return tensors, decoded
    return quantize
