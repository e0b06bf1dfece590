"""DraftModelProposer: a smaller checkpoint with the target's vocabulary proposes the draft tokens.

**Its KV cache.** The draft model has its own small paged KV cache and its own :class:`BlockPool`
(prefix caching off), with the target's block size. Each request the drafter has seen owns a draft
sequence (a :class:`Request` used only as the pool's bookkeeping record: its ``num_computed_tokens`` is
the number of the target request's tokens whose draft K/V is written, its ``block_ids`` the draft
blocks). Rollback is implicit: the draft K/V written for *draft* positions is never counted as computed
(after proposing, ``num_computed_tokens`` = the target's real token count), so the next proposal
recomputes from the last real token onwards, which overwrites whatever drafts had left there; the
accepted drafts are recomputed as the real tokens they have become (a few rows of an extend forward).
A draft sequence holds at most ``K - 1`` slots past its real tokens; it is freed when its request is
no longer running (finished, aborted or preempted; a preempted request starts again from its prompt).

**Per proposal** (one call per engine step, batched over the requests that want drafts): one extend
forward over each request's tokens that the draft has not seen (the whole prompt the first time: the
draft prefill is not chunked, so a long prompt costs one draft forward of its length), then ``K - 1``
one-token forwards, each sampling the next draft. Greedy requests take the argmax; sampled requests draw
from the draft's distribution with the request's own temperature / top-k / top-p and keep it (``q``) for
the rejection test.

Capacity: the draft pool has as many blocks as the target's plus ``K`` slots' worth per lane. Because
the target shares prefix-cached blocks between requests and the draft does not, the draft pool can run
out first; a request that does not fit simply gets no drafts (it decodes one token per step) until
room frees up.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.core.block_pool import BlockPool
from services.engine.core.request import Request
from services.engine.core.sampling_params import SamplingParams
from services.engine.errors import SpeculativeDecodingError
from services.engine.model.kv_cache import KVCache, KVCacheDtype, KVCacheSpec
from services.engine.model.loader import load_model
from services.engine.model.model import CausalLM
from services.engine.model.model_config import ModelConfig
from services.engine.model.model_runner import ModelRunner, RunnerSeq
from services.engine.model.sampler import sampling_probs
from services.engine.model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class DraftTarget:
    """One request that wants ``num_tokens`` drafts to follow ``token_ids`` (its prompt + output)."""

    request_id: str
    token_ids: Sequence[int]
    num_tokens: int
    params: SamplingParams
    generator: torch.Generator | None


@dataclass(frozen=True, slots=True)
class DraftProposal:
    """``token_ids``: the drafts (possibly fewer than asked); ``probs`` ``[len, V]``: the draft
    distributions they were sampled from (None for greedy requests, whose drafts are argmaxes)."""

    token_ids: list[int]
    probs: torch.Tensor | None


class DraftModelProposer:
    """Owns the draft model, its KV cache and block pool. One thread (the engine's step loop) uses it."""

    def __init__(
        self,
        path: Path,
        *,
        target: CausalLM,
        target_config: ModelConfig,
        target_tokenizer: Tokenizer,
        num_draft_tokens: int,
        num_target_blocks: int,
        block_size: int,
        max_concurrency: int,
        max_context: int,
        kv_dtype: KVCacheDtype,
        lm_head_draft: bool,
        device: torch.device,
    ) -> None:
        self.model, self.config = load_model(path, dtype=target.dtype, device=device)
        check_compatible(path, self.config, Tokenizer.from_dir(path), target_config, target_tokenizer, max_context)
        if lm_head_draft:
            if self.config.hidden_size != target_config.hidden_size:
                raise SpeculativeDecodingError(
                    f"--lm-head-draft needs the draft's hidden size ({self.config.hidden_size}) to equal the "
                    f"target's ({target_config.hidden_size})"
                )
            # The same Parameter object: no copy; the draft's own head is simply not used.
            self.model.lm_head = target.lm_head
        self.num_draft_tokens = num_draft_tokens
        self.block_size = block_size
        per_lane = -(-num_draft_tokens // block_size) + 1
        self.num_blocks = num_target_blocks + max_concurrency * per_lane
        spec = KVCacheSpec(
            num_layers=self.config.num_hidden_layers, num_kv_heads=self.config.num_key_value_heads,
            head_dim=self.config.head_dim, block_size=block_size, dtype=target.dtype, kv_cache_dtype=kv_dtype,
        )
        self.kv_cache = KVCache(spec, self.num_blocks, device)
        self.pool = BlockPool(self.num_blocks, block_size, enable_caching=False)
        self.runner = ModelRunner(self.model, self.config, self.kv_cache, block_size, device)
        self._seqs: dict[str, Request] = {}

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def release_except(self, live_request_ids: Iterable[str]) -> None:
        """Free the draft state of every request not in ``live_request_ids`` (no longer running)."""
        live = set(live_request_ids)
        for rid in [r for r in self._seqs if r not in live]:
            self.pool.free(self._seqs.pop(rid))

    def propose(self, targets: Sequence[DraftTarget]) -> dict[str, DraftProposal]:
        """Drafts for each target that fits in the draft pool (the others are left out)."""
        active: list[tuple[DraftTarget, Request]] = []
        seqs: list[RunnerSeq] = []
        for t in targets:
            seq = self._seqs.get(t.request_id)
            if seq is None:
                seq = Request(t.request_id, (), SamplingParams(), arrival_s=0.0)
                self._seqs[t.request_id] = seq
            # Always feed at least the last real token: its logits give the first draft.
            seq.num_computed_tokens = min(seq.num_computed_tokens, len(t.token_ids) - 1)
            new = t.token_ids[seq.num_computed_tokens :]
            if not self.pool.allocate_slots(seq, len(new) + t.num_tokens - 1):
                self.pool.free(self._seqs.pop(t.request_id))
                continue
            seqs.append(RunnerSeq(token_ids=list(new), start_pos=seq.num_computed_tokens,
                                  block_table=list(seq.block_ids), needs_logits=True))
            active.append((t, seq))
        drafts: dict[str, list[int]] = {t.request_id: [] for t, _ in active}
        probs: dict[str, list[torch.Tensor]] = {t.request_id: [] for t, _ in active}
        for step in range(self.num_draft_tokens):
            if not active:
                break
            logits = self.runner.run(seqs)
            for row, (t, seq) in enumerate(active):
                token = sample_draft(logits[row : row + 1], t, probs[t.request_id])
                drafts[t.request_id].append(token)
                if step == 0:
                    seq.num_computed_tokens = len(t.token_ids)  # the real tokens' draft K/V is now written
            still = [(i, t, s) for i, (t, s) in enumerate(active) if len(drafts[t.request_id]) < t.num_tokens]
            active = [(t, s) for _, t, s in still]
            # Draft K/V at draft positions is written but not counted as computed (see the module docstring).
            seqs = [RunnerSeq(token_ids=[drafts[t.request_id][-1]],
                              start_pos=len(t.token_ids) + len(drafts[t.request_id]) - 1,
                              block_table=list(s.block_ids), needs_logits=True) for _, t, s in still]
        return {
            rid: DraftProposal(tokens, torch.cat(probs[rid]) if probs[rid] else None)
            for rid, tokens in drafts.items()
        }



def sample_draft(logits: torch.Tensor, target: DraftTarget, probs_out: list[torch.Tensor]) -> int:
    """One draft token from ``logits`` ``[1, V]``: the argmax for a greedy request, else a draw from the
    request's sampling distribution, which is appended to ``probs_out`` (``q`` for the rejection test)."""
    if target.params.is_greedy:
        return int(logits.argmax(dim=-1))
    q = sampling_probs(logits, target.params)
    probs_out.append(q)
    return int(torch.multinomial(q[0], 1, generator=target.generator))


def check_compatible(
    path: Path,
    draft: ModelConfig,
    draft_tokenizer: Tokenizer,
    target: ModelConfig,
    target_tokenizer: Tokenizer,
    max_context: int,
) -> None:
    """The draft must speak the target's vocabulary (same size, same token for every id) and reach
    the engine's context length. Raises SpeculativeDecodingError naming the mismatch."""
    if draft.vocab_size != target.vocab_size:
        raise SpeculativeDecodingError(
            f"draft model {path} has vocab_size {draft.vocab_size}, the target {target.vocab_size}: "
            "the draft must use the target's tokenizer"
        )
    if draft_tokenizer.vocab_size != target_tokenizer.vocab_size or any(
        draft_tokenizer.id_to_token(i) != target_tokenizer.id_to_token(i) for i in range(target_tokenizer.vocab_size)
    ):
        raise SpeculativeDecodingError(f"draft model {path} has a different tokenizer from the target's")
    if draft.max_position_embeddings < max_context:
        raise SpeculativeDecodingError(
            f"draft model {path} handles {draft.max_position_embeddings} positions, fewer than the engine's "
            f"max context {max_context}: lower --max-context"
        )
