"""ModelConfig: the subset of a Hugging Face ``config.json`` the engine's decoder needs.

Built once at load time (``ModelConfig.from_dir`` / ``from_dict``) and frozen afterwards. It accepts both
config layouts seen in the wild: the transformers-4 one (``rope_theta`` + ``rope_scaling``, ``torch_dtype``)
and the transformers-5 one (``rope_parameters``, ``dtype``). A missing required key, or a feature we do not
implement (sliding windows, MLP bias, an unknown RoPE type), stops loading with a ModelLoadError naming it
rather than silently computing something different from the reference model.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.engine.errors import ModelLoadError, UnsupportedArchitectureError
from services.engine.model.quant.scheme import QuantConfig, read_quant_config

# architectures[0] -> family name used throughout the engine.
ARCHITECTURE_FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # mixture-of-experts variants: the same attention as their dense family, a sparse MLP (MoEConfig)
    "Qwen3MoeForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2",
    "MixtralForCausalLM": "llama",
}
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")
# Router keys of other MoE families (DeepSeek-V2/V3 grouped sigmoid routing, scaled weights, bias-corrected
# scores): a config naming one is refused rather than routed by plain softmax top-k.
_UNSUPPORTED_ROUTER_KEYS = ("scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor",
                            "n_routed_experts", "moe_layer_freq", "router_type", "num_shared_experts")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")

_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)

# Per-family defaults for optional keys, copied from the transformers config classes so a sparse
# config.json means what it means to transformers.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048},
    "qwen2": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768},
    "qwen3": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768},
}


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling. ``rope_type`` is "linear" (divide all frequencies by ``factor``) or "llama3"
    (divide only the low frequencies, smoothly, using the three extra fields)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """A sparse MLP: softmax router over ``num_experts``, top ``top_k`` experts per token, their weights
    renormalised to sum to 1 when ``norm_topk_prob`` (Mixtral always; Qwen as its config says), plus an
    optional shared expert gated by ``sigmoid(x @ shared_expert_gate)`` (Qwen2-MoE). ``sparse_layers[i]``:
    layer i is sparse (else a dense MLP of ``intermediate_size``). ``naming``: the checkpoint's tensor names,
    "qwen" (``mlp.gate``, ``mlp.experts.E.{gate,up,down}_proj``) or "mixtral"
    (``block_sparse_moe.experts.E.w1/w3/w2``)."""

    naming: str
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int
    sparse_layers: tuple[bool, ...]


def _parse_moe(arch: str, d: dict[str, Any], num_layers: int, source: str) -> MoEConfig:
    for key in _UNSUPPORTED_ROUTER_KEYS:
        if d.get(key) is not None and not (key == "routed_scaling_factor" and d[key] == 1.0):
            raise ModelLoadError(source, f"unsupported MoE router option {key!r}={d[key]!r} "
                                         "(supported: softmax top-k routing)")
    if d.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(source, f"unsupported hidden_act {d['hidden_act']!r} (only 'silu')")
    num_experts = d.get("num_experts") or d.get("num_local_experts")
    top_k = d.get("num_experts_per_tok")
    if not num_experts or not top_k or not 0 < int(top_k) <= int(num_experts):
        raise ModelLoadError(source, f"MoE config needs num_experts (or num_local_experts) and num_experts_per_tok "
                                     f"<= it, got {num_experts!r} and {top_k!r}")
    if arch == "MixtralForCausalLM":
        return MoEConfig(naming="mixtral", num_experts=int(num_experts), top_k=int(top_k),
                         intermediate_size=int(d["intermediate_size"]), norm_topk_prob=True,
                         shared_intermediate_size=0, sparse_layers=(True,) * num_layers)
    if d.get("moe_intermediate_size") is None:
        raise ModelLoadError(source, "missing required key 'moe_intermediate_size'")
    step = int(d.get("decoder_sparse_step") or 1)
    mlp_only = set(d.get("mlp_only_layers") or [])
    shared = int(d.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    if arch == "Qwen2MoeForCausalLM" and shared <= 0:
        raise ModelLoadError(source, "missing required key 'shared_expert_intermediate_size'")
    # transformers' Qwen2/3-MoE decoder layer: sparse when not in mlp_only_layers and (i + 1) % step == 0
    return MoEConfig(naming="qwen", num_experts=int(num_experts), top_k=int(top_k),
                     intermediate_size=int(d["moe_intermediate_size"]),
                     norm_topk_prob=bool(d.get("norm_topk_prob", False)), shared_intermediate_size=shared,
                     sparse_layers=tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(num_layers)))


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Decoder hyper-parameters. Sizes are counts; ``head_dim`` is per attention head."""

    architecture: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    torch_dtype: str  # "float32" | "bfloat16" | "float16"
    attention_bias: bool  # bias on q/k/v projections
    o_proj_bias: bool  # bias on the attention output projection (Llama/Qwen3 attention_bias; never Qwen2)
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Multi-token-prediction modules stored as ``mtp.*`` tensors (DeepSeek-V3 ``num_nextn_predict_layers``,
    # Qwen3-Next ``mtp_num_hidden_layers``); 0 when the config names none. Only ``--spec mtp`` loads them.
    num_mtp_layers: int = 0
    # The checkpoint's quantization_config (or ModelOpt hf_quant_config.json); None for dense weights.
    quant: QuantConfig | None = None
    moe: MoEConfig | None = None  # a mixture-of-experts model's sparse MLPs

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.torch_dtype]

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``path/config.json``; a missing or unparsable file is a ModelLoadError."""
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(str(path), "config.json not found")
        try:
            raw = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(str(config_path), f"config.json is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ModelLoadError(str(config_path), "config.json is not a JSON object")
        config = cls.from_dict(raw, source=str(config_path))
        if config.quant is None and (quant := read_quant_config(Path(path), raw, str(config_path))) is not None:
            config = dataclasses.replace(config, quant=quant)  # hf_quant_config.json beside a plain config.json
        return config

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Validate and normalise a parsed config.json. ``source`` only labels error messages."""
        architectures = d.get("architectures")
        if not architectures or not isinstance(architectures, list):
            raise ModelLoadError(source, "missing required key 'architectures'")
        family = ARCHITECTURE_FAMILIES.get(architectures[0])
        if family is None:
            raise UnsupportedArchitectureError(str(architectures[0]), source)
        for key in _REQUIRED_KEYS:
            if d.get(key) is None:
                raise ModelLoadError(source, f"missing required key {key!r}")
        defaults = _FAMILY_DEFAULTS[family]

        def get(key: str) -> Any:
            value = d.get(key)
            return defaults[key] if value is None else value

        if d.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(source, f"unsupported hidden_act {d['hidden_act']!r} (only 'silu')")
        if d.get("mlp_bias"):
            raise ModelLoadError(source, "unsupported 'mlp_bias': true")
        if d.get("use_sliding_window"):
            raise ModelLoadError(source, "unsupported 'use_sliding_window': true")

        num_heads = int(d["num_attention_heads"])
        hidden_size = int(d["hidden_size"])
        num_kv_heads = int(d.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads != 0:
            raise ModelLoadError(
                source,
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}",
            )
        head_dim = int(d.get("head_dim") or hidden_size // num_heads)

        rope_theta, rope_scaling = _parse_rope(
            d, get("rope_theta"), int(get("max_position_embeddings")), source
        )

        dtype_name = d.get("torch_dtype") or d.get("dtype") or "float32"
        if dtype_name not in DTYPES:
            raise ModelLoadError(
                source, f"unsupported torch_dtype {dtype_name!r} (supported: {', '.join(DTYPES)})"
            )

        # Qwen2 hard-codes bias on q/k/v and none on o_proj whatever the config says; Llama and Qwen3
        # put `attention_bias` on all four projections (transformers' modeling code, v4 and v5).
        attention_bias = bool(d.get("attention_bias", False))
        qkv_bias = True if family == "qwen2" else attention_bias
        o_bias = False if family == "qwen2" else attention_bias

        eos = d.get("eos_token_id")
        eos_ids: tuple[int, ...] = (
            () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        )
        bos = d.get("bos_token_id")

        return cls(
            architecture=family,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(get("max_position_embeddings")),
            torch_dtype=str(dtype_name),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            qk_norm=family == "qwen3",
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            num_mtp_layers=int(d.get("num_nextn_predict_layers") or d.get("mtp_num_hidden_layers") or 0),
            quant=read_quant_config(Path(), d, source) if d.get("quantization_config") is not None else None,
            moe=_parse_moe(architectures[0], d, int(d["num_hidden_layers"]), source)
            if architectures[0] in MOE_ARCHITECTURES else None,
        )


def _parse_rope(
    d: dict[str, Any], default_theta: float, max_position_embeddings: int, source: str
) -> tuple[float, RopeScaling | None]:
    """Return (theta, scaling) from either ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (transformers 4). ``type`` is the legacy spelling of ``rope_type``."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(source, "rope_scaling must be an object")
    theta = params.get("rope_theta") or d.get("rope_theta") or default_theta
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            source, f"unsupported rope type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return float(theta), None
    if params.get("factor") is None:
        raise ModelLoadError(source, f"rope type {rope_type!r} needs key 'factor'")
    if rope_type == "linear":
        return float(theta), RopeScaling(rope_type="linear", factor=float(params["factor"]))
    for key in ("low_freq_factor", "high_freq_factor"):
        if params.get(key) is None:
            raise ModelLoadError(source, f"rope type 'llama3' needs key {key!r}")
    return float(theta), RopeScaling(
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings") or max_position_embeddings
        ),
    )
