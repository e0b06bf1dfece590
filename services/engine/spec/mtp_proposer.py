"""MTPProposer: the checkpoint's own MTP module proposes the draft tokens (``--spec mtp``).

**Inputs.** The MTP needs the main model's hidden state at every position it is to cover, and only the
target forward computes those. So the engine hands the proposer, after every step, each running request's
*kept* positions of that step (:class:`MTPRows`: prefill chunks, plain decodes, and the accepted part of a
verification, with the token that follows each position and the target's hidden state there), and the
proposer runs the MTP over all of them in one extend forward. That keeps the MTP's K/V complete for every
position the target has computed, whether or not the request wants drafts this step.

**Its KV cache** is one layer, indexed by the *target's* block ids (vLLM does the same: draft layers
live in the target's KV cache manager): position ``p`` of a request sits in the MTP cache at the same
block and offset as in the target's. Consequences:

* prefix caching carries MTP K/V along with the target's: a request that hits a cached block reads the
  MTP K/V written by the request that computed it (its hidden states are not recomputed; the entry at a
  block's last position was computed with that request's next token, which may differ: drafts only);
* rollback is the scheduler's: blocks released after a rejection are released for both caches, and an
  MTP entry at a position past ``num_computed_tokens`` is overwritten before anything reads it (a row
  attends to positions ``<= p`` only, all written by then);
* no second block pool, so no second capacity limit.

The recursive steps (``k >= 1``) write at positions past the request's computed tokens: into the
request's own last, partly filled block (private: the prefix cache only shares full blocks) and beyond
it into *scratch* blocks past the target's block ids, ``ceil(K / block_size) + 1`` per lane, reused by
every proposal.

**Per proposal**: one extend forward over the step's kept rows, whose last row per request gives the
first draft; then ``K - 1`` one-row forwards, step ``k`` at position ``p + k`` with the token drafted at
step ``k - 1`` and the MTP's own output hidden state there (:mod:`mtp_head`). Greedy requests take the
argmax; sampled ones draw with their own sampling parameters and keep ``q`` for rejection sampling, as
``draft_model`` does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.model.attention import SeqSpan, build_attention_metadata
from services.engine.model.kv_cache import KVCache, KVCacheDtype, KVCacheSpec
from services.engine.model.loader import load_mtp_head
from services.engine.model.model import CausalLM
from services.engine.model.model_config import ModelConfig
from services.engine.spec.draft_model import DraftProposal, DraftTarget, sample_draft


@dataclass(frozen=True, slots=True)
class MTPRows:
    """One request's kept positions of a target step: ``start_pos .. start_pos + n - 1``, with
    ``next_token_ids[i]`` the token at position ``start_pos + i + 1`` and ``hidden[i]`` the target's
    final-normed hidden state at ``start_pos + i`` (``[n, H]``). ``block_table``: the request's blocks."""

    request_id: str
    start_pos: int
    next_token_ids: Sequence[int]
    hidden: torch.Tensor
    block_table: Sequence[int]


class MTPProposer:
    """Owns the MTP module and its one-layer KV cache. One thread (the engine's step loop) uses it."""

    def __init__(
        self,
        path: Path,
        *,
        target: CausalLM,
        target_config: ModelConfig,
        num_draft_tokens: int,
        num_target_blocks: int,
        block_size: int,
        max_concurrency: int,
        kv_dtype: KVCacheDtype,
        device: torch.device,
    ) -> None:
        self.head = load_mtp_head(path, target, target_config)
        self.num_draft_tokens = num_draft_tokens
        self.block_size = block_size
        self.num_target_blocks = num_target_blocks
        self.scratch_per_lane = -(-num_draft_tokens // block_size) + 1
        spec = KVCacheSpec(
            num_layers=1, num_kv_heads=target_config.num_key_value_heads, head_dim=target_config.head_dim,
            block_size=block_size, dtype=target.dtype, kv_cache_dtype=kv_dtype,
        )
        self.kv_cache = KVCache(spec, num_target_blocks + max_concurrency * self.scratch_per_lane, device)
        self.device = device

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.head.parameters())

    def propose(self, rows: Sequence[MTPRows], targets: Mapping[str, DraftTarget]) -> dict[str, DraftProposal]:
        """Write the MTP K/V of every row, then draft for each request in ``targets`` that has rows (its
        last row is its last real position). Requests without rows this step get no proposal."""
        rows = [r for r in rows if len(r.next_token_ids)]
        if not rows:
            return {}
        with torch.inference_mode():
            spans = [SeqSpan(r.start_pos, len(r.next_token_ids), r.block_table) for r in rows]
            meta, positions = build_attention_metadata(spans, self.block_size, self.device)
            ids = torch.tensor([t for r in rows for t in r.next_token_ids], dtype=torch.long, device=self.device)
            out = self.head(ids, torch.cat([r.hidden for r in rows]), positions, meta, self.kv_cache)
            last_rows: list[int] = []
            lanes: list[tuple[MTPRows, DraftTarget]] = []
            end = 0
            for r in rows:
                end += len(r.next_token_ids)
                target = targets.get(r.request_id)
                if target is not None and target.num_tokens > 0:
                    last_rows.append(end - 1)
                    lanes.append((r, target))
            if not lanes:
                return {}
            hidden = out[last_rows]
            drafts: dict[str, list[int]] = {t.request_id: [] for _, t in lanes}
            probs: dict[str, list[torch.Tensor]] = {t.request_id: [] for _, t in lanes}
            logits = self.head.compute_logits(hidden)
            for i, (_, t) in enumerate(lanes):
                drafts[t.request_id].append(sample_draft(logits[i : i + 1], t, probs[t.request_id]))
            # Recursive steps; hidden[j] is the MTP output of lane active[j] at its latest position.
            active = list(range(len(lanes)))
            for step in range(1, self.num_draft_tokens):
                keep = [j for j, i in enumerate(active) if len(drafts[lanes[i][1].request_id]) < lanes[i][1].num_tokens]
                if not keep:
                    break
                if len(keep) < len(active):
                    hidden = hidden[keep]
                    active = [active[j] for j in keep]
                spans = []
                for i in active:
                    r = lanes[i][0]
                    pos = r.start_pos + len(r.next_token_ids) - 1 + step
                    spans.append(SeqSpan(pos, 1, self._table_with_scratch(r.block_table, i, pos)))
                meta, positions = build_attention_metadata(spans, self.block_size, self.device)
                ids = torch.tensor([drafts[lanes[i][1].request_id][-1] for i in active], dtype=torch.long,
                                   device=self.device)
                hidden = self.head(ids, hidden, positions, meta, self.kv_cache)
                logits = self.head.compute_logits(hidden)
                for row, i in enumerate(active):
                    t = lanes[i][1]
                    drafts[t.request_id].append(sample_draft(logits[row : row + 1], t, probs[t.request_id]))
        return {
            rid: DraftProposal(tokens, torch.cat(probs[rid]) if probs[rid] else None)
            for rid, tokens in drafts.items()
        }

    def _table_with_scratch(self, block_table: Sequence[int], lane: int, pos: int) -> list[int]:
        """The request's blocks, extended with lane ``lane``'s scratch blocks up to position ``pos``."""
        table = list(block_table)
        first_scratch = self.num_target_blocks + lane * self.scratch_per_lane
        needed = pos // self.block_size + 1
        table.extend(range(first_scratch, first_scratch + max(0, needed - len(table))))
        return table
