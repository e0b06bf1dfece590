"""TritonPagedAttention: the ``AttentionBackend`` (attention.py) built from the Triton kernels.

Per layer and step: ``write_kv`` stores the new K/V (quantising to fp8 when the cache is fp8), then
* a step whose every sequence has exactly one new token (pure decode, the CUDA-graph case) runs the
  split-KV ``decode_attention``;
* any other step (prompt chunks, speculative verification rows, decode mixed with prefill) runs
  ``extend_attention`` over all sequences at once: a one-token sequence is a chunk of length 1.

It reads only the metadata's device tensors plus two host numbers the builder already has (the number
of tokens and the longest chunk), so it never syncs on the device. Same contract and numerics as
``TorchPagedAttention``, which is its oracle in tests/unit/engine/test_triton_kernels.py.
"""

from __future__ import annotations

import torch

from services.engine.kernels.decode_attention import decode_attention, default_num_splits
from services.engine.kernels.extend_attention import extend_attention
from services.engine.kernels.kv_write import write_kv
from services.engine.model.attention import AttentionMetadata
from services.engine.model.kv_cache import KVCache


class TritonPagedAttention:
    """Paged attention on CUDA via Triton (on CPU only under ``TRITON_INTERPRET=1``, for tests).

    ``num_splits``: split-KV factor for decode steps; None picks ``default_num_splits`` per step from the
    longest context (a CUDA-graph runner passes a fixed value so the captured launch shape stays valid).
    Tile sizes default to GPU values; tests pass small ones to keep the interpreter fast.
    """

    def __init__(
        self,
        *,
        num_splits: int | None = None,
        decode_block_n: int = 32,
        extend_block_m: int = 64,
        extend_block_n: int = 64,
    ) -> None:
        self.num_splits = num_splits
        self.decode_block_n = decode_block_n
        self.extend_block_m = extend_block_m
        self.extend_block_n = extend_block_n

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache.key_caches[layer_idx], kv_cache.value_caches[layer_idx]
        k_scale = kv_cache.k_scales[layer_idx : layer_idx + 1]
        v_scale = kv_cache.v_scales[layer_idx : layer_idx + 1]
        write_kv(k, v, key_cache, value_cache, meta.slot_mapping, k_scale, v_scale)
        num_seqs = meta.num_seqs
        if meta.num_tokens == num_seqs:
            num_splits = self.num_splits or default_num_splits(meta.max_seq_len, num_seqs, key_cache.shape[2])
            return decode_attention(
                q, key_cache, value_cache, meta.block_tables, meta.seq_lens, k_scale, v_scale,
                num_splits=num_splits, block_n=self.decode_block_n,
            )
        starts = meta.query_start_loc_list
        max_query_len = max(starts[i + 1] - starts[i] for i in range(num_seqs))
        return extend_attention(
            q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, k_scale, v_scale,
            max_query_len=max_query_len, block_m=self.extend_block_m, block_n=self.extend_block_n,
        )
