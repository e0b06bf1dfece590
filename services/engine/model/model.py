"""CausalLM: one decoder for the Llama, Qwen2 and Qwen3 families over a paged KV cache.

The three families share everything but two details, both driven by ModelConfig:
* Qwen2 puts a bias on the q/k/v projections (``config.attention_bias``);
* Qwen3 RMS-normalises every query and key head before RoPE (``config.qk_norm``).

The model works on a whole step's tokens flattened into one ``[T]`` row (no padding); which rows belong
to which sequence, and where their K/V live, is the AttentionMetadata's business. q/k/v and gate/up are
each one fused matmul (the loader concatenates the checkpoint's tensors): on CPU a tiny model's step
time is dominated by per-op overhead, so two fewer matmuls per layer is measurable.

Numerics follow transformers' eager implementation op for op (RMSNorm in float32 then cast back, cos/sin
computed in float32 from integer positions then cast to the activation dtype), which is what the
greedy-equivalence tests hold us to.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.kernels import cpu_kernels as cpu_kernels
from services.engine.kernels.backend import Backend
from services.engine.model.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from services.engine.model.kv_cache import KVCache
from services.engine.model.model_config import ModelConfig
from services.engine.model.quant.linear import PackedPart, QuantizedLinear, dequantize_parts, fp8_quant_dequant

# oneDNN's fp32 GEMM (the kernel inductor picks on CPU) against MKL's, which F.linear calls: on the bench
# machine (AMD EPYC, 2 cores) oneDNN is 1.5-2.8x faster for every step-sized shape except one-row products
# with small weights, where its fixed cost loses (7 us vs 16 us for 1 x 256 x 512). Table in
# docs/benchmarks.md. Bench shapes: tiny decode at 32 rows 157 us -> 85 us (gate/up), lm_head 948 -> 401 us.
# Weights under 64 Ki elements stay on MKL: too small for the choice to matter, and that keeps the test
# fixtures' tiny models on the kernel transformers uses (a different summation order can flip a near-tie
# argmax; on the bench shapes greedy outputs still match transformers token for token).
_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
_ONEDNN_MIN_MACS = 1 << 20  # rows * out * in at which oneDNN starts to win
_ONEDNN_MIN_WEIGHT = 1 << 16  # out * in


# Weights also kept in oneDNN's blocked layout (prepack_linear_weights), keyed by the weight tensor: a
# product against the packed copy is 10-25 % faster at every row count measured (1 x 1536 x 256: 28 -> 22
# us; 32 x 8192 x 256: 399 -> 298 us) and bit-identical to the plain-layout oneDNN product above one row.
# The copy doubles those weights' memory, so only models up to _PREPACK_MAX_BYTES of them are packed.
# Keyed by id() with a weak reference to check it is still that weight (tensors compare elementwise, so
# they cannot be weak dictionary keys); an entry goes when its weight does.
_PACKED: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
_PREPACK_MAX_BYTES = 1 << 30
_PREPACK_ROWS_HINT = 32
# Bumped by every packing: a compiled Decoder (CausalLM._compiled_decoder) holds the packed copies it was
# built with, and is rebuilt when this moved, so it always multiplies by what linear() would.
_pack_generation = 0


def prepack_linear_weights(weights: list[torch.Tensor]) -> int:
    """Pack the float32 CPU ``weights`` that :func:`linear` sends to oneDNN; returns the bytes packed (0
    when oneDNN is missing, the weights are on another device or dtype, or they are too big to copy)."""
    eligible = [w for w in weights if w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2
                and w.shape[0] * w.shape[1] >= _ONEDNN_MIN_WEIGHT and _packed(w) is None]
    total = sum(w.numel() * w.element_size() for w in eligible)
    if _ONEDNN_LINEAR is None or not eligible or total > _PREPACK_MAX_BYTES:
        return 0
    global _pack_generation
    for w in eligible:
        _PACKED[id(w)] = (weakref.ref(w), torch.ops.mkldnn._reorder_linear_weight(w, _PREPACK_ROWS_HINT))
        weakref.finalize(w, _PACKED.pop, id(w), None)
    _pack_generation += 1
    return total


def _packed(weight: torch.Tensor) -> torch.Tensor | None:
    entry = _PACKED.get(id(weight))
    return entry[1] if entry is not None and entry[0]() is weight else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a 2-D ``x``, through oneDNN where that is faster (float32 on CPU, big enough)."""
    # A weight is packed only when _ONEDNN_LINEAR exists; the test says so to the type checker too.
    if _PACKED and _ONEDNN_LINEAR is not None and (packed := _packed(weight)) is not None and x.dtype == torch.float32:
        packed_out: torch.Tensor = _ONEDNN_LINEAR(x, packed, bias, "none", [], "")
        return packed_out
    weight_numel = weight.shape[0] * weight.shape[1]
    if (
        _ONEDNN_LINEAR is not None
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and weight_numel >= _ONEDNN_MIN_WEIGHT
        and x.shape[0] * weight_numel >= _ONEDNN_MIN_MACS
    ):
        out: torch.Tensor = _ONEDNN_LINEAR(x, weight, bias, "none", [], "")
        return out
    return F.linear(x, weight, bias)


def qlinear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            quant: QuantizedLinear | None) -> torch.Tensor:
    """:func:`linear` of a layer that may be quantized: its input rounded as the checkpoint asks (W8A8), its
    weight dequantised now when the layer keeps it packed (``--quant-dequant per-product``), or the Triton
    GEMM that dequantises in the tile when the layer has a kernel form (triton backend, per-product)."""
    if quant is None:
        return linear(x, weight, bias)
    if quant.kernel is not None:
        y = quant.kernel.matmul(x)
        return y if bias is None else y + bias
    return linear(quant.input(x), quant.weight(weight), bias)


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Weights are filled by the loader; inference never needs gradients.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = _param(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` over the last dim, computed in float32 and cast back (transformers' order).

    In float32 this is one fused ``F.rms_norm`` call, bit-identical to the six-op form below (checked over
    the bench shapes) and one dispatch instead of six: a tiny model's decode step runs ~40 norms. On the
    CPU, once a model has loaded the compiled kernels (``kernels/cpu_kernels.py``), their RMSNorm: the
    same order of operations in one pass, equal to ``F.rms_norm`` within float rounding (tested).
    """
    if x.dtype == torch.float32:
        if cpu_kernels.rms_norm is not None and x.device.type == "cpu":
            return cpu_kernels.rms_norm(x, weight, eps)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` float32, with the config's scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # "llama3": keep high frequencies, divide low ones by `factor`, interpolate in between
    # (transformers' _compute_llama3_parameters).
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``signed_sin`` ``[T, 1, head_dim]`` in ``dtype`` for ``positions`` ``[T]`` (see _apply_rope)."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, H, D]``; ``cos``/``signed_sin`` ``[T, 1, D]`` in x's dtype.

    transformers computes ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``. The
    sign is folded into ``signed_sin = cat(-sin1, sin2)`` once per step, so here the rotation is a plain
    roll: ``(-a) * b == a * (-b)`` exactly in IEEE arithmetic, so the result is bit-identical, in 4 ops
    instead of 7.
    """
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


_NO_WEIGHT = torch.empty(0)  # qk_norm_rope's "no per-head norm"


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_weight = _param(q_size + 2 * kv_size, config.hidden_size, dtype=dtype, device=device)
        self.qkv_bias = (
            _param(q_size + 2 * kv_size, dtype=dtype, device=device) if config.attention_bias else None
        )
        self.o_weight = _param(config.hidden_size, q_size, dtype=dtype, device=device)
        self.o_bias = _param(config.hidden_size, dtype=dtype, device=device) if config.o_proj_bias else None
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device) if config.qk_norm else None
        self.qkv_quant: QuantizedLinear | None = None  # set by the loader for a quantized checkpoint
        self.o_quant: QuantizedLinear | None = None

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One fused projection → per-head views ``[T, H, D]`` of q, k and v."""
        num_tokens = x.shape[0]
        q, k, v = torch.split(qlinear(x, self.qkv_weight, self.qkv_bias, self.qkv_quant), self.split_sizes, dim=-1)
        return (q.view(num_tokens, self.num_heads, self.head_dim), k.view(num_tokens, self.num_kv_heads, self.head_dim),
                v.view(num_tokens, self.num_kv_heads, self.head_dim))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self._qkv(x)
        norm_rope = cpu_kernels.qk_norm_rope
        if norm_rope is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            # the compiled kernel: the per-head norms and RoPE of q and k in one call instead of ~10
            if self.q_norm is not None and self.k_norm is not None:
                q, k = norm_rope(q, k, cos, signed_sin, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            else:
                q, k = norm_rope(q, k, cos, signed_sin, _NO_WEIGHT, _NO_WEIGHT, 0.0)
        else:
            if self.q_norm is not None and self.k_norm is not None:
                q = rms_norm(q, self.q_norm.weight, self.q_norm.eps)
                k = rms_norm(k, self.k_norm.weight, self.k_norm.eps)
            q, k = _apply_rope(q, cos, signed_sin), _apply_rope(k, cos, signed_sin)
        o = backend.forward(self.layer_idx, q, k, v, meta, kv_cache)
        return qlinear(o.reshape(num_tokens, -1), self.o_weight, self.o_bias, self.o_quant)

    def forward_triton(self, x: torch.Tensor, positions: torch.Tensor, rope_cos: torch.Tensor,
                       rope_sin: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache,
                       backend: AttentionBackend) -> torch.Tensor:
        """forward() with the Triton kernels: per-head norms and RoPE in place on the qkv views."""
        from services.engine.kernels import rms_norm as kn
        from services.engine.kernels import rope as kr

        num_tokens = x.shape[0]
        q, k, v = self._qkv(x)
        if self.q_norm is not None and self.k_norm is not None:
            q = kn.rms_norm(q, self.q_norm.weight, self.q_norm.eps)
            k = kn.rms_norm(k, self.k_norm.weight, self.k_norm.eps)
        kr.rope_(q, k, positions, rope_cos, rope_sin)
        o = backend.forward(self.layer_idx, q, k, v, meta, kv_cache)
        return qlinear(o.reshape(num_tokens, -1), self.o_weight, self.o_bias, self.o_quant)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one ``[2I, H]`` weight."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.gate_up_weight = _param(
            2 * config.intermediate_size, config.hidden_size, dtype=dtype, device=device
        )
        self.down_weight = _param(config.hidden_size, config.intermediate_size, dtype=dtype, device=device)
        self.gate_up_quant: QuantizedLinear | None = None  # set by the loader for a quantized checkpoint
        self.down_quant: QuantizedLinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = qlinear(x, self.gate_up_weight, None, self.gate_up_quant).chunk(2, dim=-1)
        return qlinear(F.silu(gate) * up, self.down_weight, None, self.down_quant)

    def forward_triton(self, h: torch.Tensor) -> torch.Tensor:
        from services.engine.kernels import activation as ka

        gate_up = qlinear(h, self.gate_up_weight, None, self.gate_up_quant)
        return qlinear(ka.silu_and_mul(gate_up), self.down_weight, None, self.down_quant)


def _weight(dense: torch.Tensor, parts: tuple[PackedPart, ...] | None) -> torch.Tensor:
    """``dense`` itself, or ``parts`` dequantised now into its dtype (``dense`` is then empty)."""
    return dense if parts is None else dequantize_parts(parts, dense)


def _expert_weight(dense: torch.Tensor, parts: tuple[tuple[PackedPart, ...], ...] | None,
                   expert: int) -> torch.Tensor:
    """Expert ``expert``'s weight: its slice of ``dense``, or its stored parts dequantised now (``dense`` empty)."""
    return dense[expert] if parts is None else dequantize_parts(parts[expert], dense)


def _act_fp8(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """``x`` itself, or rounded through dynamic FP8 (a W8A8 product's input; ``group`` 0: per token)."""
    return x if group is None else fp8_quant_dequant(x, group)


class MoE(nn.Module):
    """A sparse SwiGLU MLP (Qwen2/3-MoE, Mixtral): softmax router, top-k experts per token, renormalised as the
    config says, experts run on the groups of tokens routed to them; plus Qwen2-MoE's sigmoid-gated shared
    expert. The router's softmax is in float32 and its weights are cast back to the activation dtype before
    they scale the experts' outputs (transformers' order). Expert e's gate and up are fused
    (``gate_up_weight[e]`` ``[2I, H]``)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        h, i = config.hidden_size, moe.intermediate_size
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate_weight = _param(moe.num_experts, h, dtype=dtype, device=device)
        self.gate_up_weight = _param(moe.num_experts, 2 * i, h, dtype=dtype, device=device)
        self.down_weight = _param(moe.num_experts, h, i, dtype=dtype, device=device)
        s = moe.shared_intermediate_size
        self.shared_gate_up_weight = _param(2 * s, h, dtype=dtype, device=device) if s else None
        self.shared_down_weight = _param(h, s, dtype=dtype, device=device) if s else None
        self.shared_gate_weight = _param(1, h, dtype=dtype, device=device) if s else None
        # the triton backend's packed experts (kernels/fused_moe.py ExpertWeights), set by the loader with
        # --quant-dequant per-product; the dense gate_up_weight / down_weight are then empty
        self.gate_up_experts: Any = None
        self.down_experts: Any = None
        # the torch backend's packed experts (--quant-dequant per-product): expert e's stored parts ((gate, up) or
        # (down,)), dequantised for its product only when a token is routed to it; the dense gate_up_weight /
        # down_weight are then empty. The shared expert's likewise (its fused gate/up parts, its down part).
        self.gate_up_parts: tuple[tuple[PackedPart, ...], ...] | None = None
        self.down_parts: tuple[tuple[PackedPart, ...], ...] | None = None
        self.shared_gate_up_parts: tuple[PackedPart, ...] | None = None
        self.shared_down_parts: tuple[PackedPart, ...] | None = None
        # W8A8 experts (the loader, from the checkpoint's input_activations): every expert product's input is
        # rounded through dynamic per-token FP8 (0: one scale per token; else per group of that width) first
        self.act_group: int | None = None
        self.shared_act_group: int | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights ``[T, k]`` in x's dtype, expert ids ``[T, k]``) of each token."""
        probs = F.softmax(F.linear(x, self.gate_weight), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` plus Qwen2-MoE's sigmoid-gated shared expert of ``x`` (``out`` itself without one)."""
        if self.shared_gate_up_weight is not None and self.shared_down_weight is not None \
                and self.shared_gate_weight is not None:
            g = self.shared_act_group
            gate, up = linear(_act_fp8(x, g), _weight(self.shared_gate_up_weight, self.shared_gate_up_parts)
                              ).chunk(2, dim=-1)
            shared = linear(_act_fp8(F.silu(gate) * up, g), _weight(self.shared_down_weight, self.shared_down_parts))
            out = out + torch.sigmoid(F.linear(x, self.shared_gate_weight)) * shared
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        # token groups: one product pair per expert that any token of the step picked (with packed experts, only
        # those experts are dequantised, one at a time)
        for expert in torch.unique(experts).tolist():
            rows, slot = torch.where(experts == expert)
            gate_up_weight = _expert_weight(self.gate_up_weight, self.gate_up_parts, expert)
            gate, up = F.linear(_act_fp8(x[rows], self.act_group), gate_up_weight).chunk(2, dim=-1)
            y = F.linear(_act_fp8(F.silu(gate) * up, self.act_group),
                         _expert_weight(self.down_weight, self.down_parts, expert))
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return self.shared(x, out)

    def forward_triton(self, h: torch.Tensor) -> torch.Tensor:
        """The routed experts in one fused-MoE kernel launch per projection (kernels/fused_moe.py), on the
        experts' dense weights or, where the loader kept them quantized, their packed form."""
        if self.act_group is not None or self.gate_up_parts is not None or self.down_parts is not None:
            # the fused kernel has no FP8-activation path (W8A8 experts), nor takes the torch per-product parts
            return self.forward(h)
        from services.engine.kernels.fused_moe import ExpertWeights, fused_moe

        weights, experts = self.route(h)
        gate_up = self.gate_up_experts or ExpertWeights(kind="dense", weight=self.gate_up_weight)
        down = self.down_experts or ExpertWeights(kind="dense", weight=self.down_weight)
        return self.shared(h, fused_moe(h, gate_up, down, weights, experts))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(config, layer_idx, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.is_sparse = config.moe is not None and config.moe.sparse_layers[layer_idx]
        self.mlp: MLP | MoE = MoE(config, dtype, device) if self.is_sparse else MLP(config, dtype, device)

    def linear_weights(self) -> list[torch.Tensor]:
        attn, mlp = self.self_attn, self.mlp
        if isinstance(mlp, MoE):
            shared = [w for w in (mlp.shared_gate_up_weight, mlp.shared_down_weight) if w is not None]
            return [attn.qkv_weight, attn.o_weight, *shared]
        return [attn.qkv_weight, attn.o_weight, mlp.gate_up_weight, mlp.down_weight]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        # Sub-modules are called through .forward: nn.Module.__call__ costs a few us of hook checks per
        # call, and a decode step of a tiny model is made of such microseconds.
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        attn_in = rms_norm(x, norm1.weight, norm1.eps)
        x = x + self.self_attn.forward(attn_in, cos, signed_sin, meta, kv_cache, backend)
        return x + self.mlp.forward(rms_norm(x, norm2.weight, norm2.eps))


class CausalLM(nn.Module):
    """Decoder-only LM. Parameters are allocated uninitialised; ``services.engine.model.loader`` fills them.

    ``attention`` is the backend every layer calls (TorchPagedAttention unless told otherwise).
    """

    inv_freq: torch.Tensor  # RoPE inverse frequencies [head_dim / 2], float32 (a non-persistent buffer)
    rope_cos: torch.Tensor  # the Triton path's RoPE tables (non-persistent buffers, only with backend="triton")
    rope_sin: torch.Tensor

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        attention: AttentionBackend | None = None,
        backend: Backend = "torch",
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.backend = backend
        if attention is None and backend == "triton":
            from services.engine.model.triton_attention import TritonPagedAttention

            attention = TritonPagedAttention()
        if attention is None and torch.device(device).type == "cpu" and dtype == torch.float32:
            attention = TorchPagedAttention(cpu_kernels.fused_decode())
        self.attention: AttentionBackend = attention or TorchPagedAttention()
        self.embed_tokens = _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype, device) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        # Tied: the same Parameter object, so one copy in memory and the loader fills it once.
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        )
        self.register_buffer("inv_freq", rope_inv_freq(config).to(device), persistent=False)
        self._decoder: tuple[int, Any] | None = None  # (pack generation, cpu_kernels.Decoder)
        # True when some layer quantizes its input or dequantises per product (set by the loader): the
        # compiled decoder multiplies by the dense weights it was handed, so it is not used then.
        self.has_quantized_forward = False
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # the compiled decoder's RoPE tables
        if backend == "triton":
            from services.engine.kernels.reference import rope_cos_sin_cache

            cos, sin = rope_cos_sin_cache(self.inv_freq, config.max_position_embeddings)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        """``input_ids``, ``positions`` ``[T]`` long → final-normed hidden states ``[T, hidden_size]``.

        Writes each token's K/V into ``kv_cache`` at ``meta.slot_mapping`` as a side effect.
        """
        if self.backend == "triton":
            return self._forward_triton(input_ids, positions, meta, kv_cache)
        if (decoder := self._decoder_for(kv_cache)) is not None:
            return self._compiled_forward_meta(decoder, input_ids, meta, kv_cache, [])[1]
        x = F.embedding(input_ids, self.embed_tokens)
        cos, signed_sin = rope_tables(positions, self.inv_freq, x.dtype)
        for layer in self.layers:
            x = layer.forward(x, cos, signed_sin, meta, kv_cache, self.attention)
        return rms_norm(x, self.norm.weight, self.norm.eps)

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       kv_cache: KVCache, logit_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` and :meth:`compute_logits` of the hidden rows ``logit_rows`` ``[R]``:
        ``(logits [R, vocab] float32, hidden [T, hidden_size])``."""
        if (decoder := self._decoder_for(kv_cache)) is not None:
            return self._compiled_forward_meta(decoder, input_ids, meta, kv_cache, logit_rows.tolist())
        hidden = self(input_ids, positions, meta, kv_cache)
        if not logit_rows.numel():
            return torch.empty((0, self.config.vocab_size), dtype=torch.float32, device=hidden.device), hidden
        return self.compute_logits(hidden[logit_rows]), hidden

    def compiled_step(self, kv_cache: KVCache, input_ids: Sequence[int], query_start_loc: Sequence[int],
                      seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]], block_size: int,
                      logit_rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`forward_logits` of a step given as plain lists (``query_start_loc`` [B+1] and ``seq_lens``
        [B] as in AttentionMetadata, each sequence's block table), when this model runs on the compiled
        decoder: no metadata tensors are built. None when it does not (build the metadata and call
        :meth:`forward_logits`)."""
        if (decoder := self._decoder_for(kv_cache)) is None:
            return None
        return self._compiled_forward(decoder, input_ids, query_start_loc, seq_lens, block_tables, block_size,
                                      kv_cache, logit_rows)

    def _decoder_for(self, kv_cache: KVCache) -> Any | None:
        """The compiled decoder when this model runs on it over ``kv_cache`` (never over an fp8 cache)."""
        return None if kv_cache.is_fp8 else self._compiled_decoder()

    def _compiled_forward_meta(self, decoder: Any, input_ids: torch.Tensor, meta: AttentionMetadata,
                               kv_cache: KVCache, logit_rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_compiled_forward` of a step given as metadata tensors (the module API's callers)."""
        return self._compiled_forward(decoder, input_ids.tolist(), meta.query_start_loc_list, meta.seq_lens_list,
                                      meta.block_tables.tolist(), meta.block_size, kv_cache, logit_rows)

    def _compiled_forward(self, decoder: Any, input_ids: Sequence[int], query_start_loc: Sequence[int],
                          seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]], block_size: int,
                          kv_cache: KVCache, logit_rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        cos, signed_sin = self._rope_table(max(seq_lens))
        hidden, logits = decoder.forward(input_ids, query_start_loc, seq_lens, block_tables, block_size, cos,
                                         signed_sin, kv_cache.key_caches, kv_cache.value_caches, logit_rows)
        return logits, hidden

    def _rope_table(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed_sin ``[P, head_dim]`` for positions 0 .. P-1 with P >= ``num_positions`` (rope_tables
        of ``arange(P)``: the same products, so the same values as a step's own tables). Grown by doubling."""
        table = self._rope
        if table is None or table[0].shape[0] < num_positions:
            size = max(1024, 1 << (num_positions - 1).bit_length())
            positions = torch.arange(size, device=self.inv_freq.device)
            cos, signed_sin = rope_tables(positions, self.inv_freq, self.dtype)
            table = self._rope = (cos.reshape(size, -1), signed_sin.reshape(size, -1))
        return table

    def _compiled_decoder(self) -> Any | None:
        """The compiled whole-forward (``cpu_kernels.Decoder``) when this model runs on it: float32 on the
        CPU, with the attention backend the model made itself (a backend handed in is always honoured).
        Built on first use, and again after new weights were packed (it holds the packed copies)."""
        decoder_cls = cpu_kernels.Decoder
        attention = self.attention
        if (decoder_cls is None or not isinstance(attention, TorchPagedAttention) or attention.fused_decode is None
                or self.dtype != torch.float32 or self.embed_tokens.device.type != "cpu" or self.has_quantized_forward
                or self.config.moe is not None):
            return None
        if self._decoder is not None and self._decoder[0] == _pack_generation:
            return self._decoder[1]

        def product(weight: torch.Tensor, bias: torch.Tensor | None) -> list[torch.Tensor]:
            packed = _packed(weight)
            return [weight, _NO_WEIGHT if packed is None else packed, _NO_WEIGHT if bias is None else bias]

        layers = []
        for layer in cast(list[DecoderLayer], list(self.layers)):
            attn, mlp = layer.self_attn, layer.mlp
            layers.append([
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                _NO_WEIGHT if attn.q_norm is None else attn.q_norm.weight,
                _NO_WEIGHT if attn.k_norm is None else attn.k_norm.weight,
                *product(attn.qkv_weight, attn.qkv_bias), *product(attn.o_weight, attn.o_bias),
                *product(mlp.gate_up_weight, None), *product(mlp.down_weight, None),
            ])
        config = self.config
        decoder = decoder_cls(self.embed_tokens, self.norm.weight, product(self.lm_head, None), layers,
                              config.rms_norm_eps,
                              config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                              _ONEDNN_LINEAR is not None)
        self._decoder = (_pack_generation, decoder)
        return decoder

    def _forward_triton(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                        kv_cache: KVCache) -> torch.Tensor:
        """The CUDA path: the residual stream carried separately, every x + sublayer(x) fused into the next
        norm (services/engine/kernels); numerically the torch path's (tests/unit/engine/test_triton_kernels.py)."""
        from services.engine.kernels import rms_norm as kn

        residual = F.embedding(input_ids, self.embed_tokens)
        x: torch.Tensor | None = None
        for layer in cast("Iterable[DecoderLayer]", self.layers):
            norm1, norm2, mlp = layer.input_layernorm, layer.post_attention_layernorm, layer.mlp
            if x is None:
                h = kn.rms_norm(residual, norm1.weight, norm1.eps)
            else:
                h, residual = kn.fused_add_rms_norm(x, residual, norm1.weight, norm1.eps)
            x = layer.self_attn.forward_triton(h, positions, self.rope_cos, self.rope_sin, meta, kv_cache,
                                               self.attention)
            h, residual = kn.fused_add_rms_norm(x, residual, norm2.weight, norm2.eps)
            x = mlp.forward_triton(h)
        if x is None:
            return kn.rms_norm(residual, self.norm.weight, self.norm.eps)
        return kn.fused_add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def linear_weights(self) -> list[torch.Tensor]:
        """Every weight :func:`linear` multiplies by (the LM head too; the embedding is looked up, not)."""
        out: list[torch.Tensor] = [self.lm_head]
        for layer in self.layers:
            out += cast(DecoderLayer, layer).linear_weights()
        return out

    def weight_bytes(self) -> int:
        """Bytes of every weight this model holds: its parameters (a tied LM head once) and the stored tensors
        of layers kept packed (``--quant-dequant per-product``)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        for layer in cast("Iterable[DecoderLayer]", self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            mlp_quant = (mlp.gate_up_quant, mlp.down_quant) if isinstance(mlp, MLP) else ()
            for quant in (attn.qkv_quant, attn.o_quant, *mlp_quant):
                if quant is not None and quant.parts is not None:
                    total += sum(part.num_bytes for part in quant.parts)
            if isinstance(mlp, MoE):
                for by_expert in (mlp.gate_up_parts, mlp.down_parts):
                    total += sum(part.num_bytes for parts in by_expert or () for part in parts)
                for parts in (mlp.shared_gate_up_parts, mlp.shared_down_parts):
                    total += sum(part.num_bytes for part in parts or ())
        return total

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[N, hidden_size]`` → logits ``[N, vocab_size]`` in float32."""
        return linear(hidden, self.lm_head).float()
