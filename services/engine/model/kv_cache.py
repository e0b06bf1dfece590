"""How big the KV cache is: free device memory, the share the cache may take, and the context that fits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.errors import EngineError
from services.engine.model.attention import KVCache, KVCacheSpec

# Share of the free memory the KV cache may take when no capacity is given.
DEFAULT_KV_MEMORY_FRACTION = 0.25


def free_memory_bytes(device: torch.device) -> int:
    """Free VRAM on CUDA, else available RAM (MemAvailable)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 30


@dataclass(frozen=True)
class SizedKVCache:
    """The allocated cache, the tokens it holds (block 0 excluded) and the context an engine may serve."""

    kv_cache: KVCache
    kv_capacity_tokens: int
    max_context: int


def allocate_kv_cache(spec: KVCacheSpec, device: torch.device, *, free_bytes: int, capacity_tokens: int | None,
                      memory_fraction: float, max_concurrency: int, max_context: int | None,
                      model_max_context: int) -> SizedKVCache:
    """Allocate the KV cache: ``capacity_tokens`` when given, else a share of ``free_bytes``; and clamp the
    served context to what fits. Raises EngineError when an explicit ``max_context`` does not fit."""
    block_size = spec.block_size
    if capacity_tokens is not None:
        # +1 block: block 0 is the scheduler's reserved null block.
        kv_cache = KVCache.for_capacity_tokens(spec, capacity_tokens + block_size, device)
    else:
        # From free memory, but no more than every lane at full context twice over (the second
        # half keeps finished prefixes cached): beyond that, memory buys nothing.
        budget = int(free_bytes * memory_fraction)
        context = max_context or model_max_context
        useful_tokens = 2 * max_concurrency * context + block_size
        budget = min(budget, useful_tokens * spec.bytes_per_token)
        kv_cache = KVCache.for_byte_budget(spec, budget, device)
    kv_capacity_tokens = (kv_cache.num_blocks - 1) * block_size
    served = min(max_context or model_max_context, model_max_context)
    if served > kv_capacity_tokens and max_context is not None:
        raise EngineError(
            f"max_context {served} exceeds the KV capacity of {kv_capacity_tokens} tokens: "
            "raise --kv-capacity or lower --max-context"
        )
    return SizedKVCache(kv_cache, kv_capacity_tokens, min(served, kv_capacity_tokens))
