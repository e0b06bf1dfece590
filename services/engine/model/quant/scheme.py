"""QuantConfig: what a checkpoint's ``quantization_config`` says about each linear layer.

Parsed once at start-up from config.json (``quantization_config``) or, for ModelOpt exports that only carry
it there, ``hf_quant_config.json``. Every method, format, strategy and option we do not implement stops
loading with a ModelLoadError naming it: a quantized checkpoint read as a dense one fails later with a
shape error, or serves garbage. The layouts behind each :class:`WeightFormat` are in docs/quantization.md.

Supported (``quant_method`` → format):
* ``compressed-tensors`` (llm-compressor): ``float-quantized`` / ``naive-quantized`` FP8 e4m3 weights with
  ``strategy`` ``tensor`` | ``channel`` | ``block``, optional dynamic per-token FP8 ``input_activations``;
  ``nvfp4-pack-quantized`` (``tensor_group``, group 16); ``pack-quantized`` (int W4A16 / W8A16, ``channel`` or
  ``group`` strategy, symmetric or with packed zero points, ``actorder`` group through ``weight_g_idx``).
* ``fp8`` (transformers FineGrainedFP8, DeepSeek-V3 / Qwen3-FP8): ``weight_block_size`` [128, 128] with
  ``weight_scale_inv``; ``activation_scheme`` ``dynamic``.
* ``modelopt`` / hf_quant_config.json ``quant_algo`` ``NVFP4`` (and ``FP8`` per-tensor).
* ``awq`` (``version`` ``gemm``, 4 bits, zero points) and ``gptq`` (4/8 bits, sym or asym, ``desc_act``
  through ``g_idx``).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.engine.errors import ModelLoadError


class WeightFormat(enum.Enum):
    FP8 = "fp8"  # float8_e4m3fn weight + weight_scale (per tensor [1] or per channel [out, 1])
    FP8_BLOCK = "fp8_block"  # float8_e4m3fn weight + block scales (weight_scale_inv or weight_scale)
    NVFP4_CT = "nvfp4_ct"  # compressed-tensors: weight_packed, weight_scale (fp8), weight_global_scale (divisor)
    NVFP4_MODELOPT = "nvfp4_modelopt"  # ModelOpt: weight (uint8), weight_scale (fp8), weight_scale_2 (multiplier)
    AWQ = "awq"  # qweight int32 [in, out/8] (AWQ order), qzeros, scales [in/g, out]
    GPTQ = "gptq"  # qweight int32 [in*bits/32, out], qzeros, scales, g_idx
    INT_CT = "int_ct"  # compressed-tensors pack-quantized: weight_packed int32 [out, in*bits/32], weight_scale,
    #                    weight_shape, weight_zero_point when asymmetric, weight_g_idx with actorder "group"


@dataclass(frozen=True, kw_only=True)
class WeightScheme:
    """How one linear layer's weight is stored, and whether its input is quantized on the fly.

    ``group_size``: input columns per scale (NVFP4 16, AWQ/GPTQ the config's; 0 = whole row).
    ``block``: ``(rows, cols)`` of one FP8 block scale. ``act_dynamic_fp8``: ``None`` or the per-token group
    width of dynamic FP8 activation quantisation (0: one scale per token over the whole row)."""

    format: WeightFormat
    bits: int = 8
    group_size: int = 0
    block: tuple[int, int] | None = None
    symmetric: bool = True
    scale_name: str = "weight_scale"  # FP8_BLOCK: "weight_scale_inv" (transformers fp8) or "weight_scale" (CT)
    zero_point_offset: int = 0  # GPTQ v1 stores zero - 1
    act_dynamic_fp8: int | None = None
    act_order: bool = False  # INT_CT: actorder "group", each input column's group stored as weight_g_idx


@dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """The checkpoint's quantization: a scheme per linear layer (by module name), ``None`` for layers left dense."""

    method: str
    rules: tuple[tuple[tuple[str, ...], WeightScheme], ...]  # (targets, scheme), first match wins
    ignore: tuple[str, ...] = field(default=())

    def scheme_for(self, module: str) -> WeightScheme | None:
        """The scheme of the linear layer ``module`` (e.g. ``model.layers.0.self_attn.q_proj``)."""
        if any(_matches(pattern, module) for pattern in self.ignore):
            return None
        for targets, scheme in self.rules:
            if any(_matches(target, module) for target in targets):
                return scheme
        return None


def _matches(pattern: str, module: str) -> bool:
    """compressed-tensors target/ignore matching: ``re:<regex>`` (re.match), the class name ``Linear`` (every
    linear layer; our loader only asks about linear layers), else the module name or its last components;
    ModelOpt's ``exclude_modules`` use fnmatch-style ``*``."""
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if "*" in pattern:
        return re.fullmatch(re.escape(pattern).replace(r"\*", ".*"), module) is not None
    return module == pattern or module.endswith("." + pattern)


def read_quant_config(root: Path, raw: Mapping[str, Any], source: str) -> QuantConfig | None:
    """The QuantConfig of the checkpoint at ``root`` whose parsed config.json is ``raw``; None when dense."""
    qc = raw.get("quantization_config")
    if qc is None:
        hf_quant = root / "hf_quant_config.json"
        if not hf_quant.is_file():
            return None
        try:
            doc = json.loads(hf_quant.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(str(hf_quant), f"hf_quant_config.json is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict) or not isinstance(doc.get("quantization"), dict):
            raise ModelLoadError(str(hf_quant), "hf_quant_config.json has no 'quantization' object")
        return parse_quant_config({"quant_method": "modelopt", **doc["quantization"]}, str(hf_quant))
    if not isinstance(qc, dict):
        raise ModelLoadError(source, "quantization_config must be an object")
    return parse_quant_config(qc, source)


def parse_quant_config(qc: Mapping[str, Any], source: str) -> QuantConfig:
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, source)
    if method == "fp8":
        return _fine_grained_fp8(qc, source)
    if method == "modelopt":
        return _modelopt(qc, source)
    if method == "awq":
        return _awq(qc, source)
    if method == "gptq":
        return _gptq(qc, source)
    raise ModelLoadError(
        source, f"unsupported quantization_config.quant_method {method!r} "
        "(supported: compressed-tensors, fp8, modelopt, awq, gptq)")


def _refuse(source: str, key: str, value: object, supported: Iterable[object] | str) -> ModelLoadError:
    allowed = supported if isinstance(supported, str) else ", ".join(repr(s) for s in supported)
    return ModelLoadError(source, f"unsupported quantization_config {key} {value!r} (supported: {allowed})")


# --- compressed-tensors ---------------------------------------------------------------------------------

_CT_FORMATS = ("float-quantized", "naive-quantized", "nvfp4-pack-quantized", "pack-quantized")


def _compressed_tensors(qc: Mapping[str, Any], source: str) -> QuantConfig:
    status = qc.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):
        raise _refuse(source, "quantization_status", status, ("compressed", "frozen"))
    if qc.get("kv_cache_scheme") is not None:
        raise _refuse(source, "kv_cache_scheme", qc["kv_cache_scheme"], "null (use --kv-dtype)")
    if qc.get("sparsity_config"):
        raise _refuse(source, "sparsity_config", "…", "none")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError(source, "compressed-tensors quantization_config has no config_groups")
    top_format = qc.get("format")
    rules = []
    for name, group in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(group, dict):
            raise ModelLoadError(source, f"quantization_config {where} is not an object")
        fmt = group.get("format") or top_format
        if fmt not in _CT_FORMATS:
            raise _refuse(source, f"{where}.format", fmt, _CT_FORMATS)
        targets = group.get("targets")
        if not isinstance(targets, list) or not targets:
            raise ModelLoadError(source, f"quantization_config {where}.targets must be a non-empty list")
        if group.get("output_activations") is not None:
            raise _refuse(source, f"{where}.output_activations", group["output_activations"], "null")
        weights = group.get("weights")
        if not isinstance(weights, dict):
            raise ModelLoadError(source, f"quantization_config {where}.weights is required")
        scheme = _ct_weight_scheme(weights, str(fmt), f"{where}.weights", source)
        act = _ct_activation(group.get("input_activations"), scheme, f"{where}.input_activations", source)
        rules.append((tuple(str(t) for t in targets), _with_act(scheme, act)))
    ignore = qc.get("ignore") or []
    return QuantConfig(method="compressed-tensors", rules=tuple(rules), ignore=tuple(str(i) for i in ignore))


def _with_act(scheme: WeightScheme, act: int | None) -> WeightScheme:
    return dataclasses.replace(scheme, act_dynamic_fp8=act)


def _ct_weight_scheme(w: Mapping[str, Any], fmt: str, where: str, source: str) -> WeightScheme:
    kind, bits, strategy = w.get("type", "int"), w.get("num_bits"), w.get("strategy")
    if w.get("dynamic"):
        raise _refuse(source, f"{where}.dynamic", w["dynamic"], "false")
    actorder = w.get("actorder")
    if actorder is True or actorder == "group":  # compressed-tensors reads actorder true as "group"
        if fmt != "pack-quantized":
            raise _refuse(source, f"{where}.actorder", actorder, "null, 'static', 'weight' for " + fmt)
    elif actorder not in (None, False, "static", "weight"):
        raise _refuse(source, f"{where}.actorder", actorder, "null, 'static', 'weight', 'group'")
    if fmt == "pack-quantized":
        # llm-compressor W4A16 / W8A16: symmetric or not, one scale per output channel or per group of inputs
        if kind != "int" or bits not in (4, 8):
            raise _refuse(source, f"{where} type/num_bits", f"{kind}/{bits}", "int/4, int/8 for pack-quantized")
        if strategy == "channel":
            group = 0
        elif strategy == "group":
            size = w.get("group_size")
            if not isinstance(size, int) or size <= 0:
                raise _refuse(source, f"{where}.group_size", size, "a positive number")
            group = size
        else:
            raise _refuse(source, f"{where}.strategy", strategy, ("channel", "group"))
        is_group_order = (actorder is True or actorder == "group") and strategy == "group"
        return WeightScheme(format=WeightFormat.INT_CT, bits=int(bits), group_size=group,
                            symmetric=bool(w.get("symmetric", True)), act_order=is_group_order)
    if fmt in ("float-quantized", "naive-quantized"):
        if kind != "float" or bits != 8:
            raise _refuse(source, f"{where} type/num_bits", f"{kind}/{bits}", "float/8 for " + fmt)
        if strategy in ("tensor", "channel"):
            return WeightScheme(format=WeightFormat.FP8)
        if strategy == "block":
            block = w.get("block_structure")
            if not (isinstance(block, list) and len(block) == 2):
                raise ModelLoadError(source, f"quantization_config {where}.block_structure must be [rows, cols]")
            return WeightScheme(format=WeightFormat.FP8_BLOCK, block=(int(block[0]), int(block[1])))
        raise _refuse(source, f"{where}.strategy", strategy, ("tensor", "channel", "block"))
    if fmt == "nvfp4-pack-quantized":
        if kind != "float" or bits != 4 or strategy != "tensor_group" or w.get("group_size") != 16:
            raise _refuse(source, f"{where}", f"{kind}/{bits}/{strategy}/{w.get('group_size')}",
                          "float/4/tensor_group/16 for nvfp4-pack-quantized")
        return WeightScheme(format=WeightFormat.NVFP4_CT, bits=4, group_size=16)
    raise AssertionError(fmt)  # _CT_FORMATS and this function disagree


def _ct_activation(a: Any, scheme: WeightScheme, where: str, source: str) -> int | None:
    """Dynamic per-token FP8 activation quantisation → 0 (one scale per token); None when absent. NVFP4's
    input_activations (dynamic local, static global scale) are what the W4A4 tensor-core path needs; the
    reference computes in the compute dtype, which Hopper-class hardware (no FP4 MMA) does too."""
    if a is None:
        return None
    if not isinstance(a, dict):
        raise ModelLoadError(source, f"quantization_config {where} is not an object")
    if scheme.format is WeightFormat.NVFP4_CT:
        return None
    if scheme.format is WeightFormat.INT_CT:
        raise _refuse(source, where, "…", "null for pack-quantized (weight-only W4A16 / W8A16)")
    kind, bits, strategy, dynamic = a.get("type"), a.get("num_bits"), a.get("strategy"), a.get("dynamic")
    if kind != "float" or bits != 8:
        raise _refuse(source, f"{where} type/num_bits", f"{kind}/{bits}", "float/8")
    if dynamic is not True:
        raise _refuse(source, f"{where}.dynamic", dynamic, "true (static input_scale is not implemented)")
    if strategy == "token":
        return 0
    if strategy == "group":
        return int(a.get("group_size") or 128)
    raise _refuse(source, f"{where}.strategy", strategy, ("token", "group"))


# --- transformers FineGrainedFP8 (DeepSeek-V3, Qwen3-*-FP8) ------------------------------------------------

def _fine_grained_fp8(qc: Mapping[str, Any], source: str) -> QuantConfig:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse(source, "fmt", qc.get("fmt"), ("e4m3",))
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse(source, "activation_scheme", qc.get("activation_scheme"), ("dynamic",))
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2):
        raise _refuse(source, "weight_block_size", block, "[rows, cols], e.g. [128, 128]")
    # DeepSeek-V3 act_quant: one scale per token per weight_block_size[1] input columns.
    scheme = WeightScheme(format=WeightFormat.FP8_BLOCK, block=(int(block[0]), int(block[1])),
                          scale_name="weight_scale_inv", act_dynamic_fp8=int(block[1]))
    ignore = qc.get("modules_to_not_convert") or []
    return QuantConfig(method="fp8", rules=((("Linear",), scheme),), ignore=("lm_head", *map(str, ignore)))


# --- NVIDIA ModelOpt ------------------------------------------------------------------------------------

def _modelopt(qc: Mapping[str, Any], source: str) -> QuantConfig:
    algo = qc.get("quant_algo")
    if qc.get("kv_cache_quant_algo") not in (None, "NONE"):
        raise _refuse(source, "kv_cache_quant_algo", qc["kv_cache_quant_algo"], "null (use --kv-dtype)")
    exclude = tuple(str(m) for m in (qc.get("exclude_modules") or qc.get("ignore") or []))
    if algo == "NVFP4":
        group = qc.get("group_size", 16)
        if group != 16:
            raise _refuse(source, "group_size", group, (16,))
        scheme = WeightScheme(format=WeightFormat.NVFP4_MODELOPT, bits=4, group_size=16)
    elif algo == "FP8":
        scheme = WeightScheme(format=WeightFormat.FP8)
    else:
        raise _refuse(source, "quant_algo", algo, ("NVFP4", "FP8"))
    return QuantConfig(method="modelopt", rules=((("Linear",), scheme),), ignore=exclude)


# --- AutoAWQ / AutoGPTQ ---------------------------------------------------------------------------------

def _int_group(qc: Mapping[str, Any], source: str) -> int:
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if group == -1:
        return 0
    if group <= 0:
        raise _refuse(source, "group_size", group, "a positive number or -1")
    return group


def _awq(qc: Mapping[str, Any], source: str) -> QuantConfig:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(source, "version", qc.get("version"), ("gemm",))
    bits = qc.get("bits", qc.get("w_bit", 4))
    if bits != 4:
        raise _refuse(source, "bits", bits, (4,))
    if not qc.get("zero_point", True):
        raise _refuse(source, "zero_point", qc.get("zero_point"), (True,))
    scheme = WeightScheme(format=WeightFormat.AWQ, bits=4, group_size=_int_group(qc, source), symmetric=False)
    ignore = qc.get("modules_to_not_convert") or []
    return QuantConfig(method="awq", rules=((("Linear",), scheme),), ignore=("lm_head", *map(str, ignore)))


def _gptq(qc: Mapping[str, Any], source: str) -> QuantConfig:
    bits = qc.get("bits", 4)
    if bits not in (4, 8):
        raise _refuse(source, "bits", bits, (4, 8))
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(source, "checkpoint_format", fmt, ("gptq", "gptq_v2"))
    # desc_act is honoured through g_idx (each input column's group), read with the weight.
    scheme = WeightScheme(format=WeightFormat.GPTQ, bits=int(bits), group_size=_int_group(qc, source),
                          symmetric=bool(qc.get("sym", True)), zero_point_offset=1 if fmt == "gptq" else 0)
    ignore = qc.get("modules_to_not_convert") or []
    return QuantConfig(method="gptq", rules=((("Linear",), scheme),), ignore=("lm_head", *map(str, ignore)))
