"""EngineConfig: one engine's settings (model, device, KV cache, batching, speculation), frozen."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from services.engine.model.kv_cache import DEFAULT_KV_MEMORY_FRACTION
from services.engine.model.loader import QuantDequant
from services.engine.model.pooler import PoolingType
from services.engine.spec.spec_decode import SpecConfig


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """One engine's settings. ``kv_capacity_tokens`` None sizes the cache from free memory."""

    model_path: Path
    model_id: str | None = None
    dtype: str | None = None
    device: str = "cpu"
    backend: str | None = None  # kernels: "auto"/None (triton on CUDA, else torch), "torch", "triton"
    kv_dtype: Literal["auto", "fp8"] = "auto"
    # A quantized checkpoint: dequantise once at load ("load") or inside every product ("per-product": the
    # Triton GEMMs on the triton backend); "auto": per-product on the triton backend, else load.
    quant_dequant: QuantDequant = "load"
    kv_capacity_tokens: int | None = None
    kv_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION
    block_size: int = 16
    max_concurrency: int = 8
    max_pending_requests: int = 64
    max_context: int | None = None
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    preserve_thinking: bool = False
    # thinking models (a chat template that writes <think>): render with enable_thinking (False:
    # --no-thinking), and the default reasoning effort (None: no thinking budget) with the thinking-token
    # budget each effort allows (low, medium, high)
    enable_thinking: bool = True
    reasoning_effort: str | None = None
    reasoning_budget_tokens: tuple[int, int, int] = (1024, 4096, 16384)
    torch_threads: int | None = None
    # Decode steps through CUDA graphs where they can run (CUDA device, triton backend); False: eager always.
    cuda_graphs: bool = True
    # Outputs of a request that is already streaming are released at most this often (see
    # async_engine.StreamInterval); 0 releases every step's tokens at once. Offline generate ignores it.
    stream_interval_ms: float = 0.0
    spec: SpecConfig = field(default_factory=SpecConfig)
    # /v1/embeddings: which hidden states make a sequence's vector (model/pooler.py)
    pooling: PoolingType = "last"
