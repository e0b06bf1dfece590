"""Loading an HF-format checkpoint directory into a CausalLM.

A directory holds ``config.json`` and either ``model.safetensors`` or a sharded set described by
``model.safetensors.index.json`` (``weight_map``: tensor name → shard file). Tensor names are
transformers' (``model.layers.N.self_attn.q_proj.weight`` … ``lm_head.weight``). Every tensor the config
implies must be present with exactly the expected shape; anything else in the files (e.g. an old
``rotary_emb.inv_freq``) is ignored. q/k/v and gate/up are copied into slices of the model's fused
weights. With ``tie_word_embeddings`` the LM head *is* the embedding, and ``lm_head.weight`` is not read
even if present (transformers does the same). ``mtp.*`` tensors (a multi-token-prediction module) are
ignored by :func:`load_model` and read by :func:`load_mtp_head` only when ``--spec mtp`` asks for them.

Every failure is a ModelLoadError whose reason is one line naming the file, key or tensor at fault.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Literal, cast

import torch
from safetensors import SafetensorError, safe_open

from services.engine.errors import ModelLoadError
from services.engine.kernels.backend import Backend
from services.engine.model.model import MLP, CausalLM, DecoderLayer, MoE, prepack_linear_weights
from services.engine.model.model_config import DTYPES, ModelConfig
from services.engine.model.mtp_head import MTP_PREFIX, MTPHead
from services.engine.model.quant.formats import dequantize, stored_tensors
from services.engine.model.quant.kernel_weight import build_expert_weights, build_kernel_weight
from services.engine.model.quant.linear import PackedPart, QuantizedLinear
from services.engine.model.quant.scheme import QuantConfig, WeightScheme

QuantDequant = Literal["auto", "load", "per-product"]
QUANT_DEQUANT_MODES: tuple[QuantDequant, ...] = ("auto", "load", "per-product")
# Linear layers a quantization_config can cover (checkpoint leaf names); fused in the model as noted.
_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up",
          "up_proj": "gate_up", "down_proj": "down"}

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_model(
    path: str | Path, dtype: torch.dtype | str | None = None, device: torch.device | str = "cpu",
    backend: Backend = "torch", quant_dequant: QuantDequant = "auto",
) -> tuple[CausalLM, ModelConfig]:
    """Read the checkpoint at ``path`` and return the model (in eval mode) and its config.

    ``dtype``: the weights' dtype; ``None`` takes config.json's ``torch_dtype`` (float32 when absent).
    bfloat16 and float16 work on CPU too, just slower.
    ``quant_dequant``: for a quantized checkpoint, dequantise every layer once here (``load``), or keep the
    stored tensors and dequantise inside each product (``per-product``: less memory; on the triton backend the
    Triton GEMMs dequantise in the tile); ``auto``: per-product on the triton backend, else load.
    """
    root = Path(path)
    if not root.is_dir():
        raise ModelLoadError(str(root), "directory does not exist")
    if quant_dequant not in QUANT_DEQUANT_MODES:
        raise ModelLoadError(str(root), f"unsupported quant_dequant {quant_dequant!r} "
                                        f"(supported: {', '.join(QUANT_DEQUANT_MODES)})")
    quant_dequant = resolve_quant_dequant(quant_dequant, backend)
    config = ModelConfig.from_dir(root)
    target_dtype = _resolve_dtype(dtype, config, root)
    files = _tensor_files(root)

    model = CausalLM(config, dtype=target_dtype, device=device, backend=backend)
    expected = _expected_shapes(config)
    if config.quant is not None:
        _load_quantized(root, files, config, config.quant, model, expected, target_dtype, quant_dequant, backend,
                        torch.device(device))
    _copy_tensors(root, files, expected, lambda name: _destination(model, config, name), target_dtype)
    prepack_linear_weights(model.linear_weights())
    return model.eval(), config


def resolve_quant_dequant(mode: QuantDequant, backend: Backend) -> QuantDequant:
    """``auto`` → ``per-product`` on the triton backend (the in-tile GEMMs), ``load`` on the torch one."""
    if mode == "auto":
        return "per-product" if backend == "triton" else "load"
    return mode


def quantized_layers(config: ModelConfig) -> dict[str, WeightScheme]:
    """Checkpoint module name (``model.layers.0.self_attn.q_proj``) → its scheme, for every quantized linear
    layer of ``config``'s model (empty for a dense checkpoint)."""
    if config.quant is None:
        return {}
    out: dict[str, WeightScheme] = {}
    for name in _expected_shapes(config):
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and (module == "lm_head" or module.rpartition(".")[2] in (*_FUSED, "w1", "w2", "w3")):
            scheme = config.quant.scheme_for(module)
            if scheme is not None:
                out[module] = scheme
    return out


def _load_quantized(root: Path, files: dict[str, str], config: ModelConfig, quant: QuantConfig, model: CausalLM,
                    expected: dict[str, tuple[int, ...]], dtype: torch.dtype, mode: QuantDequant,
                    backend: Backend = "torch", device: torch.device | None = None) -> None:
    """Read every quantized layer's stored tensors; remove its ``.weight`` from ``expected`` (a dense read).

    ``load``: dequantise into the model's dense weight (one layer at a time: no second full copy).
    ``per-product``: keep the stored tensors on the layer (fused parts together) and free the dense weight;
    on the ``triton`` backend they are rearranged into the Triton GEMMs' layouts on ``device`` (kernel_weight.py)
    and each product dequantises in the tile (a layer no kernel takes stays on the torch path, logged).
    MoE experts: on the torch backend every expert (routed and shared, W8A8 too) keeps its stored tensors and
    the MoE loop dequantises an expert for its product only; on the triton backend the routed experts go to the
    fused-MoE kernel's layout, while W8A8 routed experts and the shared expert are dequantised here.
    The lm_head, where a checkpoint quantizes it, is always dequantised here (it multiplies once per step).
    """
    layers = quantized_layers(config)
    if not layers:
        return
    act_groups: dict[tuple[int, str], set[int | None]] = {}
    parts: dict[tuple[int, str], list[PackedPart]] = {}
    expert_parts: dict[tuple[int, str], dict[tuple[int, int], PackedPart]] = {}
    expert_acts: dict[tuple[int, str], set[int | None]] = {}  # (layer, routed | shared) -> activation schemes
    shared_parts: dict[tuple[int, str], dict[int, PackedPart]] = {}  # (layer, gate_up | down) -> slot -> part
    with ExitStack() as stack:
        handles: dict[str, object] = {}

        def get(name: str) -> torch.Tensor:
            file = files.get(name)
            if file is None:
                raise ModelLoadError(str(root), f"missing tensor {name!r} (the quantization_config asks for it)")
            if file not in handles:
                try:
                    handles[file] = stack.enter_context(safe_open(str(root / file), framework="pt"))
                except (OSError, SafetensorError) as exc:
                    raise ModelLoadError(str(root / file), f"cannot read safetensors file: {exc}") from exc
            return cast(torch.Tensor, handles[file].get_tensor(name))  # type: ignore[attr-defined]

        for module, scheme in layers.items():
            name = f"{module}.weight"
            shape = cast(tuple[int, int], expected.pop(name))
            is_routed = ".experts." in module
            is_shared = ".shared_expert." in module
            is_expert = is_routed or is_shared
            if is_expert:
                expert_acts.setdefault((int(module.split(".")[2]), "routed" if is_routed else "shared"),
                                       set()).add(scheme.act_dynamic_fp8)
            # On the triton backend the fused-MoE kernel has no FP8-activation path, so W8A8 routed experts are
            # dequantised at load (their inputs are rounded through dynamic FP8 in the torch loop, MoE.act_group),
            # and the shared expert is dense; the torch MoE loop takes every expert packed.
            keeps_packed = mode == "per-product" and module != "lm_head" and (
                backend == "torch" or not is_expert or (is_routed and scheme.act_dynamic_fp8 is None))
            if not keeps_packed:
                weight = _dequantized(root, scheme, get, module, shape)
                _destination(model, config, name).copy_(weight.to(dtype))
                del weight
                if module == "lm_head" or is_expert:
                    continue
            else:
                part = PackedPart(scheme=scheme, prefix=module, shape=shape,
                                  tensors={n.rsplit(".", 1)[1]: get(n) for n in stored_tensors(scheme, module)})
                try:
                    part.dequantize()  # validates shapes and dtypes now, not at the first request
                except ValueError as exc:
                    raise ModelLoadError(str(root), str(exc)) from exc
                if is_routed:
                    layer_index, projection, expert, slot = _expert_key(module)
                    expert_parts.setdefault((layer_index, projection), {})[(expert, slot)] = part
                    continue
                if is_shared:
                    layer_index, projection, slot = _shared_key(module)
                    shared_parts.setdefault((layer_index, projection), {})[slot] = part
                    continue
                parts.setdefault(_fused_key(module), []).append(part)
            act_groups.setdefault(_fused_key(module), set()).add(scheme.act_dynamic_fp8)
    for (index, projection), by_expert in expert_parts.items():
        _attach_experts(model, config, index, projection, by_expert, dtype, backend, device)
    for (index, projection), by_slot in shared_parts.items():
        _attach_shared_expert(model, config, index, projection, by_slot, dtype)
    for (index, kind), acts in expert_acts.items():
        if len(acts) != 1:
            raise ModelLoadError(str(root), f"layer {index}'s {kind} experts quantize their input differently "
                                            "(some with dynamic FP8 activations, some without)")
        moe = cast(DecoderLayer, model.layers[index]).mlp
        assert isinstance(moe, MoE)
        setattr(moe, "act_group" if kind == "routed" else "shared_act_group", next(iter(acts)))
        model.has_quantized_forward |= moe.act_group is not None or moe.shared_act_group is not None
    for (index, fused), groups in act_groups.items():
        if len(groups) != 1:
            raise ModelLoadError(str(root), f"layer {index}'s {fused} projections quantize their input differently "
                                            "(a fused product needs one scheme)")
        group = next(iter(groups))
        packed = parts.get((index, fused))
        if mode == "per-product" and packed is not None and len(packed) != _num_parts(fused):
            raise ModelLoadError(str(root), f"layer {index}'s {fused} projections are partly quantized "
                                            "(per-product dequantisation needs all or none)")
        state = QuantizedLinear(act_group=group, parts=tuple(packed) if packed else None)
        if backend == "triton" and packed is not None:
            try:
                state = QuantizedLinear(act_group=group, kernel=build_kernel_weight(
                    tuple(packed), group, device if device is not None else torch.device("cpu")))
            except ValueError as exc:
                log.warning("quantized layer %d %s stays on the torch path: %s", index, fused, exc)
        _attach(model, index, fused, state)
        model.has_quantized_forward |= state.act_group is not None or state.parts is not None \
            or state.kernel is not None


def _dequantized(root: Path, scheme: WeightScheme, get: Callable[[str], torch.Tensor], module: str,
                 shape: tuple[int, int]) -> torch.Tensor:
    try:
        return dequantize(scheme, get, module, shape)
    except ValueError as exc:
        raise ModelLoadError(str(root), str(exc)) from exc


def _expert_key(module: str) -> tuple[int, str, int, int]:
    """``model.layers.<i>.<mlp|block_sparse_moe>.experts.<e>.<proj>`` → (i, "gate_up" | "down", e, slot)."""
    parts = module.split(".")
    projection, slot = {"gate_proj": ("gate_up", 0), "w1": ("gate_up", 0), "up_proj": ("gate_up", 1),
                        "w3": ("gate_up", 1), "down_proj": ("down", 0), "w2": ("down", 0)}[parts[6]]
    return int(parts[2]), projection, int(parts[5]), slot


def _attach_experts(model: CausalLM, config: ModelConfig, index: int, projection: str,
                    by_expert: dict[tuple[int, int], PackedPart], dtype: torch.dtype, backend: Backend,
                    device: torch.device | None) -> None:
    """Give layer ``index``'s MoE its ``projection`` experts packed and free the dense weight: on the triton
    backend in the fused-MoE kernel's layout, on the torch one as each expert's stored parts (``MoE.<projection>
    _parts``, dequantised per product). When not every expert is quantized (or no tile fits), dequantise them into
    the dense weight instead."""
    moe = cast(DecoderLayer, model.layers[index]).mlp
    assert isinstance(moe, MoE) and config.moe is not None
    num_experts, num_slots = config.moe.num_experts, 2 if projection == "gate_up" else 1
    keys = [(e, s) for e in range(num_experts) for s in range(num_slots)]
    try:
        if any(k not in by_expert for k in keys):
            raise ValueError("some experts are not quantized")
        per_expert = [tuple(by_expert[(e, s)] for s in range(num_slots)) for e in range(num_experts)]
        if backend == "triton":
            setattr(moe, f"{projection}_experts", build_expert_weights(per_expert, device or torch.device("cpu")))
        else:
            setattr(moe, f"{projection}_parts", tuple(per_expert))
    except ValueError as exc:
        log.warning("layer %d's %s experts are dequantised at load: %s", index, projection, exc)
        _dequantize_into(model, config, by_expert.values(), dtype)
        return
    _free_dense(moe, f"{projection}_weight")
    model.has_quantized_forward = True


def _shared_key(module: str) -> tuple[int, str, int]:
    """``model.layers.<i>.mlp.shared_expert.<proj>`` → (i, "gate_up" | "down", slot)."""
    parts = module.split(".")
    projection, slot = {"gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}[parts[5]]
    return int(parts[2]), projection, slot


def _attach_shared_expert(model: CausalLM, config: ModelConfig, index: int, projection: str,
                          by_slot: dict[int, PackedPart], dtype: torch.dtype) -> None:
    """Give layer ``index``'s shared expert its ``projection`` stored parts (torch backend, per-product) and free
    the dense weight; when gate and up are not both quantized, dequantise the quantized one into it instead."""
    moe = cast(DecoderLayer, model.layers[index]).mlp
    assert isinstance(moe, MoE)
    num_slots = 2 if projection == "gate_up" else 1
    if any(s not in by_slot for s in range(num_slots)):
        log.warning("layer %d's shared expert %s is dequantised at load: partly quantized", index, projection)
        _dequantize_into(model, config, by_slot.values(), dtype)
        return
    setattr(moe, f"shared_{projection}_parts", tuple(by_slot[s] for s in range(num_slots)))
    _free_dense(moe, f"shared_{projection}_weight")
    model.has_quantized_forward = True


def _dequantize_into(model: CausalLM, config: ModelConfig, parts: Iterable[PackedPart], dtype: torch.dtype) -> None:
    """Each stored part dequantised into its module's dense weight (what ``load`` does for every layer)."""
    for part in parts:
        _destination(model, config, f"{part.prefix}.weight").copy_(part.dequantize().to(dtype))


def _free_dense(owner: torch.nn.Module, weight_attr: str) -> None:
    """Replace a dense weight whose packed form the module now keeps by an empty tensor of the same dtype, device
    and rank (the per-product paths take the dtype and device to dequantise into from it)."""
    dense = getattr(owner, weight_attr)
    setattr(owner, weight_attr, torch.nn.Parameter(dense.new_empty((0,) * dense.dim()), requires_grad=False))


def _fused_key(module: str) -> tuple[int, str]:
    parts = module.split(".")  # model.layers.<i>.<self_attn|mlp>.<proj>
    return int(parts[2]), _FUSED[parts[4]]


def _num_parts(fused: str) -> int:
    return {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}[fused]


def _attach(model: CausalLM, index: int, fused: str, state: QuantizedLinear) -> None:
    """Set the layer's QuantizedLinear; with packed parts, the dense weight it replaces is freed."""
    layer = cast(DecoderLayer, model.layers[index])
    owner: torch.nn.Module = layer.self_attn if fused in ("qkv", "o") else layer.mlp
    weight_attr = f"{fused}_weight"
    setattr(owner, f"{fused}_quant", state)
    if state.parts is not None or state.kernel is not None:
        _free_dense(owner, weight_attr)  # QuantizedLinear.weight() takes its dtype from the empty tensor


def load_mtp_head(path: str | Path, model: CausalLM, config: ModelConfig) -> MTPHead:
    """Read the checkpoint's ``mtp.*`` tensors (Qwen3-Next naming, one module) into an MTPHead that shares
    ``model``'s embedding and LM head, in ``model``'s dtype and device. Checkpoints without them, or with
    more than one module, are a ModelLoadError (``spec_decode.check_mtp`` words the first case for users)."""
    root = Path(path)
    files = _tensor_files(root)
    if config.num_mtp_layers > 1:
        raise ModelLoadError(str(root), f"config names {config.num_mtp_layers} MTP modules; only 1 is supported")
    stored = mtp_tensor_aliases(files, config.num_hidden_layers)
    if not stored and not any(name.startswith(MTP_PREFIX) for name in files):
        raise ModelLoadError(str(root), f"no {MTP_PREFIX}* tensors (the checkpoint has no MTP module)")
    device = model.embed_tokens.device
    head = MTPHead(config, model, dtype=model.dtype, device=device)
    _copy_tensors(root, files, _mtp_expected_shapes(config), lambda name: _mtp_destination(head, config, name),
                  model.dtype, stored)
    prepack_linear_weights([head.fc_weight, *head.layer.linear_weights()])
    return head.eval()


# DeepSeek-V3's MTP names (its HF checkpoints store the module as the layer after the last one,
# ``model.layers.<num_hidden_layers>.*``; converted ones under ``mtp.``) → the Qwen3-Next names used here.
# The math is the same (vLLM's deepseek_mtp.py and qwen3_next_mtp.py): enorm / hnorm normalise the
# embedding and the hidden state, eh_proj is fc over their concatenation, shared_head.norm is the final
# norm. shared_head.head (DeepSeek's copy of the LM head) is not read: the main LM head is used.
_DEEPSEEK_MTP_NAMES = {"enorm.weight": "pre_fc_norm_embedding.weight", "hnorm.weight": "pre_fc_norm_hidden.weight",
                       "eh_proj.weight": "fc.weight", "shared_head.norm.weight": "norm.weight"}
_BLOCK_PARTS = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")


def mtp_tensor_aliases(names: Iterable[str], num_hidden_layers: int) -> dict[str, str]:
    """Qwen3-Next MTP name → the name the checkpoint stores it under, for a DeepSeek-style MTP layout
    (``model.layers.<num_hidden_layers>.eh_proj.weight`` or ``mtp.eh_proj.weight`` present); empty for a
    Qwen3-Next layout (or none)."""
    names = set(names)
    for prefix in (f"model.layers.{num_hidden_layers}.", MTP_PREFIX):
        if f"{prefix}eh_proj.weight" not in names:
            continue
        aliases: dict[str, str] = {}
        for name in names:
            if not name.startswith(prefix):
                continue
            leaf = name.removeprefix(prefix)
            if leaf in _DEEPSEEK_MTP_NAMES:
                aliases[MTP_PREFIX + _DEEPSEEK_MTP_NAMES[leaf]] = name
            elif leaf.startswith(_BLOCK_PARTS):
                aliases[f"{MTP_PREFIX}layers.0.{leaf}"] = name
        return aliases
    return {}


def _copy_tensors(root: Path, files: dict[str, str], expected: dict[str, tuple[int, ...]],
                  destination: Callable[[str], torch.Tensor], dtype: torch.dtype,
                  stored: dict[str, str] | None = None) -> None:
    """Copy every ``expected`` tensor (name → shape) from the checkpoint into ``destination(name)``;
    ``stored`` maps an expected name to the name the checkpoint has it under, where they differ."""
    stored = stored or {}
    with ExitStack() as stack:
        handles = {}
        for name in expected:
            file = files.get(stored.get(name, name))
            if file is not None and file not in handles:
                try:
                    handles[file] = stack.enter_context(safe_open(str(root / file), framework="pt"))
                except (OSError, SafetensorError) as exc:
                    raise ModelLoadError(str(root / file), f"cannot read safetensors file: {exc}") from exc
        for name, shape in expected.items():
            stored_name = stored.get(name, name)
            source = files.get(stored_name)
            if source is None:
                raise ModelLoadError(str(root), f"missing tensor {stored_name!r}")
            tensor = handles[source].get_tensor(stored_name)
            if tuple(tensor.shape) != shape:
                raise ModelLoadError(
                    str(root / source), f"tensor {stored_name!r} has shape {tuple(tensor.shape)}, expected {shape}"
                )
            destination(name).copy_(tensor.to(dtype))


def checkpoint_tensor_names(path: str | Path) -> set[str]:
    """Names of every tensor in the checkpoint at ``path`` (headers only, no tensor is read)."""
    root = Path(path)
    if not root.is_dir():
        raise ModelLoadError(str(root), "directory does not exist")
    return set(_tensor_files(root))


def _resolve_dtype(dtype: torch.dtype | str | None, config: ModelConfig, root: Path) -> torch.dtype:
    if dtype is None:
        return config.dtype
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ModelLoadError(str(root), f"unsupported dtype {dtype} (supported: {', '.join(DTYPES)})")
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(str(root), f"unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    return DTYPES[dtype]


def _tensor_files(root: Path) -> dict[str, str]:
    """Tensor name → file name (relative to ``root``) for every tensor in the checkpoint."""
    index_path = root / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(str(index_path), f"invalid index file: {exc!r}") from exc
        for file in set(weight_map.values()):
            if not (root / file).is_file():
                raise ModelLoadError(str(root), f"shard {file!r} named in {INDEX_FILE} not found")
        return dict(weight_map)
    single = root / SINGLE_FILE
    if not single.is_file():
        raise ModelLoadError(str(root), f"neither {SINGLE_FILE} nor {INDEX_FILE} found")
    try:
        with safe_open(str(single), framework="pt") as handle:
            return {name: SINGLE_FILE for name in handle.keys()}
    except (OSError, SafetensorError) as exc:
        raise ModelLoadError(str(single), f"cannot read safetensors file: {exc}") from exc


def _layer_tensors(config: ModelConfig, prefix: str, layer_idx: int | None = None
                   ) -> Iterator[tuple[str, tuple[int, ...]]]:
    h, d = config.hidden_size, config.head_dim
    q_size, kv_size = config.num_attention_heads * d, config.num_key_value_heads * d
    yield f"{prefix}.input_layernorm.weight", (h,)
    yield f"{prefix}.post_attention_layernorm.weight", (h,)
    for proj, rows in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
        yield f"{prefix}.self_attn.{proj}.weight", (rows, h)
        if config.attention_bias:
            yield f"{prefix}.self_attn.{proj}.bias", (rows,)
    yield f"{prefix}.self_attn.o_proj.weight", (h, q_size)
    if config.o_proj_bias:
        yield f"{prefix}.self_attn.o_proj.bias", (h,)
    if config.qk_norm:
        yield f"{prefix}.self_attn.q_norm.weight", (d,)
        yield f"{prefix}.self_attn.k_norm.weight", (d,)
    moe = config.moe
    if moe is not None and layer_idx is not None and moe.sparse_layers[layer_idx]:
        i = moe.intermediate_size
        if moe.naming == "mixtral":
            yield f"{prefix}.block_sparse_moe.gate.weight", (moe.num_experts, h)
            for e in range(moe.num_experts):
                yield f"{prefix}.block_sparse_moe.experts.{e}.w1.weight", (i, h)
                yield f"{prefix}.block_sparse_moe.experts.{e}.w3.weight", (i, h)
                yield f"{prefix}.block_sparse_moe.experts.{e}.w2.weight", (h, i)
            return
        yield f"{prefix}.mlp.gate.weight", (moe.num_experts, h)
        for e in range(moe.num_experts):
            yield f"{prefix}.mlp.experts.{e}.gate_proj.weight", (i, h)
            yield f"{prefix}.mlp.experts.{e}.up_proj.weight", (i, h)
            yield f"{prefix}.mlp.experts.{e}.down_proj.weight", (h, i)
        if s := moe.shared_intermediate_size:
            yield f"{prefix}.mlp.shared_expert.gate_proj.weight", (s, h)
            yield f"{prefix}.mlp.shared_expert.up_proj.weight", (s, h)
            yield f"{prefix}.mlp.shared_expert.down_proj.weight", (h, s)
            yield f"{prefix}.mlp.shared_expert_gate.weight", (1, h)
        return
    yield f"{prefix}.mlp.gate_proj.weight", (config.intermediate_size, h)
    yield f"{prefix}.mlp.up_proj.weight", (config.intermediate_size, h)
    yield f"{prefix}.mlp.down_proj.weight", (h, config.intermediate_size)


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the model needs, with its shape, in load order."""
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, config.hidden_size)
    }
    for i in range(config.num_hidden_layers):
        shapes.update(_layer_tensors(config, f"model.layers.{i}", i))
    shapes["model.norm.weight"] = (config.hidden_size,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return shapes


def _mtp_expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The MTP module's tensors (Qwen3-Next naming): two pre-fc norms, ``fc`` ``[H, 2H]`` (input: the
    normed embedding then the normed hidden state), one decoder layer named like the model's, a final norm."""
    h = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        f"{MTP_PREFIX}pre_fc_norm_embedding.weight": (h,),
        f"{MTP_PREFIX}pre_fc_norm_hidden.weight": (h,),
        f"{MTP_PREFIX}fc.weight": (h, 2 * h),
    }
    shapes.update(_layer_tensors(config, f"{MTP_PREFIX}layers.0"))
    shapes[f"{MTP_PREFIX}norm.weight"] = (h,)
    return shapes


def _mtp_destination(head: MTPHead, config: ModelConfig, name: str) -> torch.Tensor:
    leaf = name.removeprefix(MTP_PREFIX)
    if leaf == "pre_fc_norm_embedding.weight":
        return head.pre_fc_norm_embedding.weight.data
    if leaf == "pre_fc_norm_hidden.weight":
        return head.pre_fc_norm_hidden.weight.data
    if leaf == "fc.weight":
        return head.fc_weight.data
    if leaf == "norm.weight":
        return head.norm.weight.data
    return _layer_destination(head.layer, config, leaf.split(".", 2)[2])  # "layers.0.<leaf>"


def _destination(model: CausalLM, config: ModelConfig, name: str) -> torch.Tensor:
    """The model tensor (or slice of a fused tensor) that checkpoint tensor ``name`` is copied into."""
    if name == "model.embed_tokens.weight":
        return model.embed_tokens.data
    if name == "model.norm.weight":
        return model.norm.weight.data
    if name == "lm_head.weight":
        return model.lm_head.data
    _, _, index, leaf = name.split(".", 3)
    return _layer_destination(cast(DecoderLayer, model.layers[int(index)]), config, leaf)


def _layer_destination(layer: DecoderLayer, config: ModelConfig, leaf: str) -> torch.Tensor:
    """The tensor (or fused slice) of ``layer`` that its checkpoint tensor ``leaf`` (e.g.
    ``self_attn.q_proj.weight``) is copied into."""
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    qkv_slices = {
        "q_proj": (0, q_size),
        "k_proj": (q_size, q_size + kv_size),
        "v_proj": (q_size + kv_size, q_size + 2 * kv_size),
    }
    attn, mlp = layer.self_attn, layer.mlp
    if isinstance(mlp, MoE) and leaf.startswith(("mlp.", "block_sparse_moe.")):
        return _moe_destination(mlp, config, leaf)
    match leaf.split("."):
        case ["input_layernorm", "weight"]:
            return layer.input_layernorm.weight.data
        case ["post_attention_layernorm", "weight"]:
            return layer.post_attention_layernorm.weight.data
        case ["self_attn", ("q_proj" | "k_proj" | "v_proj") as proj, "weight"]:
            lo, hi = qkv_slices[proj]
            return attn.qkv_weight.data[lo:hi]
        case ["self_attn", ("q_proj" | "k_proj" | "v_proj") as proj, "bias"]:
            lo, hi = qkv_slices[proj]
            assert attn.qkv_bias is not None
            return attn.qkv_bias.data[lo:hi]
        case ["self_attn", "o_proj", "weight"]:
            return attn.o_weight.data
        case ["self_attn", "o_proj", "bias"]:
            assert attn.o_bias is not None
            return attn.o_bias.data
        case ["self_attn", "q_norm", "weight"]:
            assert attn.q_norm is not None
            return attn.q_norm.weight.data
        case ["self_attn", "k_norm", "weight"]:
            assert attn.k_norm is not None
            return attn.k_norm.weight.data
        case ["mlp", "gate_proj", "weight"] if isinstance(mlp, MLP):
            return mlp.gate_up_weight.data[: config.intermediate_size]
        case ["mlp", "up_proj", "weight"] if isinstance(mlp, MLP):
            return mlp.gate_up_weight.data[config.intermediate_size :]
        case ["mlp", "down_proj", "weight"] if isinstance(mlp, MLP):
            return mlp.down_weight.data
    raise AssertionError(f"no destination for {leaf}")  # _expected_shapes and this table disagree


def _moe_destination(mlp: MoE, config: ModelConfig, leaf: str) -> torch.Tensor:
    """The MoE tensor (or fused slice) that checkpoint tensor ``leaf`` (``mlp.experts.3.up_proj.weight``,
    ``block_sparse_moe.experts.3.w3.weight`` …) is copied into. Mixtral: w1 = gate, w3 = up, w2 = down."""
    assert config.moe is not None
    i = config.moe.intermediate_size
    match leaf.split("."):
        case [("mlp" | "block_sparse_moe"), "gate", "weight"]:
            return mlp.gate_weight.data
        case [_, "experts", e, ("gate_proj" | "w1"), "weight"]:
            return mlp.gate_up_weight.data[int(e), :i]
        case [_, "experts", e, ("up_proj" | "w3"), "weight"]:
            return mlp.gate_up_weight.data[int(e), i:]
        case [_, "experts", e, ("down_proj" | "w2"), "weight"]:
            return mlp.down_weight.data[int(e)]
        case ["mlp", "shared_expert", proj, "weight"] if mlp.shared_gate_up_weight is not None:
            s = config.moe.shared_intermediate_size
            if proj == "gate_proj":
                return mlp.shared_gate_up_weight.data[:s]
            if proj == "up_proj":
                return mlp.shared_gate_up_weight.data[s:]
            assert mlp.shared_down_weight is not None
            return mlp.shared_down_weight.data
        case ["mlp", "shared_expert_gate", "weight"] if mlp.shared_gate_weight is not None:
            return mlp.shared_gate_weight.data
    raise AssertionError(f"no destination for {leaf}")  # _layer_tensors and this table disagree
