"""Paged attention: the per-step metadata that addresses the KV cache (kv_cache.py), and the torch backend.

Layout (vLLM-v1 style). The cache of each layer is two tensors ``[num_blocks, block_size, num_kv_heads,
head_dim]`` (keys, values). A sequence owns a *block table*: the physical block ids that hold its
positions ``0, 1, …`` in order, ``block_size`` positions per block, in any physical order. Token position
``p`` of a sequence lives in flat slot ``block_table[p // block_size] * block_size + p % block_size``.
The block pool (not this module) decides which blocks a sequence owns; this module only reads and writes
them.

One engine step computes a batch of sequences' *new* tokens, flattened with no padding: ``T`` tokens in
all, sequence ``i`` owning rows ``query_start_loc[i] : query_start_loc[i+1]``. Its new tokens are the last
``q_len`` positions of a context of ``seq_lens[i]`` tokens, so a prompt chunk and a one-token decode are
the same case.

``TorchPagedAttention`` is the CPU / test / oracle path: it writes the new K/V into the cache, then for
each sequence gathers its context from its block table and runs causal ``scaled_dot_product_attention``.
A Triton backend implements the same ``AttentionBackend`` protocol.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from services.engine.kernels.cpu_kernels import FusedDecode
from services.engine.model.kv_cache import KVCache

# ----------------------------------------------------------------------------------------------- metadata


class SeqSpanLike(Protocol):
    """What the metadata builder needs of one sequence in a step (SeqSpan, or a scheduler's own type)."""

    @property
    def start_pos(self) -> int: ...  # positions already in the KV cache
    @property
    def num_new_tokens(self) -> int: ...  # positions computed this step (>= 1)
    @property
    def block_table(self) -> Sequence[int]: ...  # covers positions 0 .. start_pos + num_new_tokens - 1


@dataclass(frozen=True, slots=True)
class SeqSpan:
    """A plain SeqSpanLike."""

    start_pos: int
    num_new_tokens: int
    block_table: Sequence[int]


@dataclass(frozen=True, kw_only=True)
class DecodeBatch:
    """The step's one-token sequences, addressed for one batched attention call (built once per step,
    read by every layer).

    ``slots[j, p]`` is the flat cache slot of position ``p`` of decode sequence ``j``; rows are padded to
    the longest context with slot 0 and ``padding`` marks the padded tail (None when no row is padded,
    e.g. a single sequence).
    """

    seq_indices: tuple[int, ...]  # which sequences of the step decode, in step order
    token_rows: torch.Tensor  # [Bd] long: their rows in the step's [T] tokens
    slots: torch.Tensor  # [Bd, L] long
    lens: torch.Tensor  # [Bd] long, on the host: each row's context length (what the fused CPU kernel reads)
    padding: torch.Tensor | None  # [Bd, L] bool, True on padded positions
    is_whole_step: bool  # every token of the step is a decode, in order: rows are 0..T-1
    # When contexts differ a lot in length, attention runs per group of similar lengths, each padded to
    # its own longest (``rows`` index the Bd decode rows): less padding gathered and attended over.
    groups: tuple[DecodeGroup, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class DecodeGroup:
    rows: torch.Tensor  # [g] long: rows of the DecodeBatch
    slots: torch.Tensor  # [g, Lg] long
    padding: torch.Tensor | None  # [g, Lg] bool


@dataclass(frozen=True, kw_only=True)
class AttentionMetadata:
    """Addresses of one step's tokens in the paged cache. Tensors live on the model's device; the
    ``*_list`` twins are the same numbers on the host, so the reference loop never syncs on a tensor."""

    slot_mapping: torch.Tensor  # [T] long: flat cache slot where each new token's K/V is written
    query_start_loc: torch.Tensor  # [B+1] long: cumulative new-token counts
    seq_lens: torch.Tensor  # [B] long: context length per sequence including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with 0
    query_start_loc_list: tuple[int, ...]
    seq_lens_list: tuple[int, ...]
    block_size: int
    # The one-token sequences batched for TorchPagedAttention, when given; else decode_batch builds them on
    # first use (a backend that never reads them, like the compiled decoder or Triton, never pays for it).
    decode: DecodeBatch | None = None

    @functools.cached_property
    def decode_batch(self) -> DecodeBatch | None:
        """``decode``, or the step's one-token sequences batched (None when it has none); built once."""
        if self.decode is not None:
            return self.decode
        return _build_decode_batch(list(self.query_start_loc_list), list(self.seq_lens_list), self.block_tables,
                                   self.block_size)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_list[-1]

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_list, default=0)


def build_attention_metadata(
    seqs: Sequence[SeqSpanLike], block_size: int, device: torch.device | str
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata plus the positions tensor ``[T]`` (long) for a step over ``seqs``, in order.

    Raises ValueError when a sequence has no new tokens or its block table does not cover its context;
    both are scheduler bugs, never user input.
    """
    slots: list[int] = []
    positions: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    for index, seq in enumerate(seqs):
        start, count = seq.start_pos, seq.num_new_tokens
        end = start + count
        if count <= 0 or start < 0:
            raise ValueError(f"sequence {index}: start_pos={start}, num_new_tokens={count}")
        num_blocks = -(-end // block_size)
        if len(seq.block_table) < num_blocks:
            raise ValueError(
                f"sequence {index}: block table has {len(seq.block_table)} blocks, "
                f"positions 0..{end - 1} need {num_blocks} of size {block_size}"
            )
        table = list(seq.block_table[:num_blocks])
        if count == 1:
            slots.append(table[start // block_size] * block_size + start % block_size)
            positions.append(start)
        else:
            # Walk block by block so a long prompt chunk costs one range() per block, not per token.
            pos = start
            while pos < end:
                block, offset = divmod(pos, block_size)
                span = min(end - pos, block_size - offset)
                base = table[block] * block_size + offset
                slots.extend(range(base, base + span))
                pos += span
            positions.extend(range(start, end))
        query_start_loc.append(query_start_loc[-1] + count)
        seq_lens.append(end)
        tables.append(table)
    max_blocks = max((len(t) for t in tables), default=0)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    block_tables = torch.tensor(padded, dtype=torch.long, device=device).reshape(len(tables), max_blocks)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.long, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device),
        block_tables=block_tables,
        query_start_loc_list=tuple(query_start_loc),
        seq_lens_list=tuple(seq_lens),
        block_size=block_size,
    )
    return meta, torch.tensor(positions, dtype=torch.long, device=device)


def _build_decode_batch(
    query_start_loc: list[int], seq_lens: list[int], block_tables: torch.Tensor, block_size: int
) -> DecodeBatch | None:
    indices = [i for i in range(len(seq_lens)) if query_start_loc[i + 1] - query_start_loc[i] == 1]
    if not indices:
        return None
    device = block_tables.device
    lens = [seq_lens[i] for i in indices]
    max_len = max(lens)
    num_blocks = -(-max_len // block_size)
    is_whole_step = len(indices) == len(seq_lens)
    index = None if is_whole_step else torch.tensor(indices, dtype=torch.long, device=device)
    tables = (block_tables if index is None else block_tables[index])[:, :num_blocks]
    offsets = torch.arange(block_size, dtype=torch.long, device=device)
    slots = (tables[:, :, None] * block_size + offsets).reshape(len(indices), -1)[:, :max_len]
    rows = torch.tensor([query_start_loc[i] for i in indices], dtype=torch.long, device=device)
    return DecodeBatch(
        seq_indices=tuple(indices), token_rows=rows, slots=slots, padding=_padding(lens, device),
        lens=torch.tensor(lens, dtype=torch.long),  # on the host: only the CPU kernel reads it
        is_whole_step=is_whole_step, groups=_length_groups(lens, slots),
    )


def _padding(lens: list[int], device: torch.device) -> torch.Tensor | None:
    """``[len(lens), max(lens)]`` bool, True past each row's length; None when no row is padded."""
    width = max(lens)
    if min(lens) == width:
        return None
    lens_t = torch.tensor(lens, dtype=torch.long, device=device)
    return torch.arange(width, device=device)[None, :] >= lens_t[:, None]


# Split the decode rows in two groups only when that removes at least this share of the padded positions
# (each group costs one more gather and SDPA call per layer).
_MIN_GROUP_SAVING = 0.25
_MIN_GROUP_ROWS = 8


def _length_groups(lens: list[int], slots: torch.Tensor) -> tuple[DecodeGroup, ...] | None:
    """Two groups of rows (shorter and longer contexts), if that pads a lot less than one; else None."""
    n = len(lens)
    if n < 2 * _MIN_GROUP_ROWS:
        return None
    order = sorted(range(n), key=lens.__getitem__)
    longest = lens[order[-1]]
    best_k, best_cost = 0, n * longest
    for k in range(_MIN_GROUP_ROWS, n - _MIN_GROUP_ROWS + 1):
        cost = k * lens[order[k - 1]] + (n - k) * longest
        if cost < best_cost:
            best_k, best_cost = k, cost
    if best_k == 0 or best_cost > (1 - _MIN_GROUP_SAVING) * n * longest:
        return None
    device = slots.device
    groups = []
    for part in (order[:best_k], order[best_k:]):
        part_lens = [lens[i] for i in part]
        index = torch.tensor(part, dtype=torch.long, device=device)
        groups.append(DecodeGroup(rows=index, slots=slots.index_select(0, index)[:, : max(part_lens)],
                                  padding=_padding(part_lens, device)))
    return tuple(groups)


# ------------------------------------------------------------------------------------------------ backends


class AttentionBackend(Protocol):
    """Attention over the paged cache for one layer of one step."""

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """Write ``k``, ``v`` ``[T, Hkv, D]`` into ``kv_cache`` at ``meta.slot_mapping``, then return causal
        attention of ``q`` ``[T, Hq, D]`` over each sequence's cached context: ``[T, Hq, D]``, q's dtype.
        Softmax scale is ``D ** -0.5``; query head ``h`` reads kv head ``h // (Hq // Hkv)``."""
        ...


class TorchPagedAttention:
    """Reference backend in plain torch (CPU, tests, oracle for the Triton kernels).

    All one-token (decode) sequences of a step share one batched attention (see :func:`_decode_attention`);
    prompt chunks run one SDPA call each with an explicit causal mask offset by the cached prefix.
    ``fused_decode`` (``kernels.cpu_kernels``): a compiled kernel that runs the decode attention straight
    from the paged cache instead, used for float32 queries over a float32 cache on the CPU.
    """

    def __init__(self, fused_decode: FusedDecode | None = None) -> None:
        self.fused_decode = fused_decode

    def _decode(self, q: torch.Tensor, decode: DecodeBatch, kv_cache: KVCache, layer_idx: int) -> torch.Tensor:
        fused = self.fused_decode
        if fused is None or kv_cache.is_fp8 or q.dtype != torch.float32 or q.device.type != "cpu":
            return _decode_attention(q, decode, kv_cache, layer_idx)
        rows = q if decode.is_whole_step else q[decode.token_rows]
        return fused(rows, kv_cache.key_caches[layer_idx], kv_cache.value_caches[layer_idx], decode.slots,
                     decode.lens, q.shape[-1] ** -0.5)

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        kv_cache.write(layer_idx, k, v, meta.slot_mapping)
        decode = meta.decode_batch
        if decode is not None and decode.is_whole_step:
            return self._decode(q, decode, kv_cache, layer_idx)
        out = torch.empty_like(q)
        starts = meta.query_start_loc_list
        block_size = meta.block_size
        for i, seq_len in enumerate(meta.seq_lens_list):
            q_start, q_end = starts[i], starts[i + 1]
            q_len = q_end - q_start
            if q_len == 1:
                continue
            if q_len == seq_len and not kv_cache.is_fp8:
                # Whole context is new: the cache would hand back exactly k and v, so skip the gather.
                keys, values = k[q_start:q_end], v[q_start:q_end]
            else:
                num_blocks = -(-seq_len // block_size)
                keys, values = kv_cache.gather(layer_idx, meta.block_tables[i, :num_blocks])
                keys, values = keys[:seq_len], values[:seq_len]
            out[q_start:q_end] = _causal_attention(q[q_start:q_end], keys, values)
        if decode is not None:
            out[decode.token_rows] = self._decode(q, decode, kv_cache, layer_idx)
        return out


def _causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Causal attention where ``q`` ``[q_len, Hq, D]`` holds the last q_len positions of the context
    ``keys``/``values`` ``[L, Hkv, D]``; returns ``[q_len, Hq, D]``."""
    q_len, context_len = q.shape[0], keys.shape[0]
    qh, kh, vh = q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
    if q_len == context_len:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    else:
        # Query i sits at position context_len - q_len + i and may see keys 0..that position.
        key_pos = torch.arange(context_len, device=q.device)
        query_pos = torch.arange(context_len - q_len, context_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    return o.transpose(0, 1)


def _decode_attention(q: torch.Tensor, decode: DecodeBatch, kv_cache: KVCache, layer_idx: int) -> torch.Tensor:
    """Attention of every decode sequence's one query over its cached context: ``[Bd, Hq, D]``.

    One gather of all contexts (padded to the longest, see DecodeBatch) and one SDPA call, masked only
    when some row is padded; or one of each per length group when the batch has ``groups``.
    """
    rows = q if decode.is_whole_step else q[decode.token_rows]
    if decode.groups is None:
        return _padded_decode_attention(rows, decode.slots, decode.padding, kv_cache, layer_idx)
    out = torch.empty_like(rows)
    for group in decode.groups:
        o = _padded_decode_attention(rows.index_select(0, group.rows), group.slots, group.padding, kv_cache, layer_idx)
        out.index_copy_(0, group.rows, o)
    return out


def _padded_decode_attention(rows: torch.Tensor, slots: torch.Tensor, padding: torch.Tensor | None,
                             kv_cache: KVCache, layer_idx: int) -> torch.Tensor:
    """One SDPA call: each row's query over its context, gathered padded to the longest."""
    keys, values = kv_cache.gather_slots(layer_idx, slots)  # [Bd, L, Hkv, D]
    num_seqs, num_q_heads, head_dim = rows.shape
    num_kv_heads = keys.shape[2]
    mask = None if padding is None else ~padding[:, None, None, :]
    # GQA as a group of query rows per KV head ([Bd, Hkv, G, D] against [Bd, Hkv, L, D]): the same
    # result as enable_gqa=True without expanding K and V per query head (~20 % less time at 32 x 384).
    o = F.scaled_dot_product_attention(
        rows.view(num_seqs, num_kv_heads, num_q_heads // num_kv_heads, head_dim),
        keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
    )  # [Bd, Hkv, G, D]
    return o.reshape(num_seqs, num_q_heads, head_dim)
