"""Pooling: a sequence's final-normed hidden states ``[T, hidden_size]`` → one L2-normalised embedding.

As vLLM's pooling runner does for decoder-only models (vllm/model_executor/layers/pooler.py: ``LAST``
pooling, ``normalize=True`` by default for embedding tasks), ``last`` takes the last token's hidden
state, ``mean`` averages every token's; both are then divided by their L2 norm (``F.normalize``, eps
1e-12). Computed in float32 whatever the model's dtype.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

PoolingType = Literal["last", "mean"]
POOLING_TYPES: tuple[PoolingType, ...] = ("last", "mean")


def pool(hidden: torch.Tensor, pooling: PoolingType) -> torch.Tensor:
    """``hidden`` ``[T, H]`` (T >= 1) → ``[H]`` float32, unit L2 norm."""
    states = hidden.float()
    vector = states[-1] if pooling == "last" else states.mean(dim=0)
    return F.normalize(vector, p=2.0, dim=0)
