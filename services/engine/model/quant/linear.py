"""QuantizedLinear: what a quantized linear layer does at forward time beyond a dense product.

Two independent parts, both optional:
* ``parts``: with ``--quant-dequant per-product`` the layer keeps its stored (packed) tensors and each forward
  dequantises them into a transient dense weight (memory: the packed bytes, plus one layer's dense weight
  while it multiplies). With the default ``load`` the loader dequantises once and ``parts`` is None.
* ``act_group``: the checkpoint asks for dynamic FP8 activation quantisation (W8A8): every product's input is
  rounded to float8_e4m3fn with one scale per token (``0``) or per token and ``act_group`` columns, as the
  FP8 GEMM would see it, then multiplied in the compute dtype (the reference of the tensor-core path).
* ``kernel``: on the triton backend with ``per-product``, the parts in the Triton GEMMs' layouts
  (kernel_weight.py): the product dequantises in the tile, and W8A8 multiplies fp8 by fp8.

:func:`dequantize_parts` is the one per-product dequantisation, shared with the torch MoE loop, whose
experts keep their parts per expert (model.py ``MoE.gate_up_parts``) rather than a QuantizedLinear each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.engine.model.quant.formats import dequantize
from services.engine.model.quant.scheme import WeightScheme


class InTileKernel(Protocol):
    """What the model needs of a layer's in-tile form (kernel_weight.py ``KernelWeight``; a protocol here so
    this module, which that one builds on, does not import it back)."""

    @property
    def num_bytes(self) -> int: ...

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...

FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# vLLM's scaled_fp8_quant floors the scale so an all-zero row does not divide by zero.
_MIN_SCALE = 1.0 / (FP8_E4M3_MAX * 512.0)


@dataclass(frozen=True, kw_only=True)
class PackedPart:
    """One checkpoint layer's stored tensors (``leaf`` → tensor, e.g. ``qweight``) and its dense shape."""

    scheme: WeightScheme
    prefix: str
    tensors: dict[str, torch.Tensor]
    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.scheme, lambda name: self.tensors[name.rsplit(".", 1)[1]], self.prefix, self.shape)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True, kw_only=True)
class QuantizedLinear:
    act_group: int | None = None
    parts: tuple[PackedPart, ...] | None = None  # concatenated along the output dimension (fused q/k/v, gate/up)
    kernel: InTileKernel | None = None  # the triton backend's in-tile form of ``parts`` (which it replaces)

    def weight(self, dense: torch.Tensor) -> torch.Tensor:
        """The weight to multiply by: ``dense`` itself, or the stored parts dequantised now, in its dtype."""
        return dense if self.parts is None else dequantize_parts(self.parts, dense)

    def input(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.act_group is None else fp8_quant_dequant(x, self.act_group)


def dequantize_parts(parts: Sequence[PackedPart], like: torch.Tensor) -> torch.Tensor:
    """``parts`` dequantised and concatenated along the output dimension (fused q/k/v, gate/up), in ``like``'s
    dtype and on its device: the transient dense weight of one product (a layer's, or one expert's)."""
    pieces = [part.dequantize() for part in parts]
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).to(device=like.device, dtype=like.dtype)


def fp8_quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[T, K]`` → (float8_e4m3fn ``[T, K]``, float32 scales ``[T, K / group]``): one dynamic scale
    ``amax / 448`` per token (``group`` 0) or per token and ``group`` columns (DeepSeek-V3's act_quant)."""
    num_tokens, width = x.shape
    g = group or width
    if width % g:
        raise ValueError(f"activation width {width} is not a multiple of the quantisation group {g}")
    h = x.float().reshape(num_tokens, width // g, g)
    scale = (h.abs().amax(-1, keepdim=True) / FP8_E4M3_MAX).clamp(min=_MIN_SCALE)
    q = (h / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(num_tokens, width), scale.reshape(num_tokens, width // g)


def fp8_quant_dequant(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` rounded through :func:`fp8_quantize` and back, in x's dtype (the reference of the W8A8 GEMM)."""
    num_tokens, width = x.shape
    q, scale = fp8_quantize(x, group)
    g = width // scale.shape[1]
    return (q.float().reshape(num_tokens, -1, g) * scale.unsqueeze(-1)).reshape(num_tokens, width).to(x.dtype)
