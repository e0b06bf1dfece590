"""Verification of draft tokens against the target model: which drafts to keep, and the token after them.

Input for one request: the target's logits (or probabilities) at the ``1 + K`` positions of a
speculative step, row ``i`` being the target's distribution for the token that follows the last known
token and drafts ``0 .. i-1``; the ``K`` draft tokens; for a model drafter, the draft distributions
``q`` they were sampled from. Output: the run of tokens to append, ``1 .. 1 + K`` long: the accepted
drafts, then one token drawn from the target where verification stopped (a corrected token after a
rejection, or a bonus token when all ``K`` were accepted).

**Greedy** (temperature 0): draft ``i`` is accepted iff it equals ``argmax`` of row ``i``; the first
mismatch is replaced by that argmax. The result is token for token what one-token-at-a-time greedy
decoding produces from the same logits.

**Sampled** (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
Algorithm 1 / Appendix A.1; Chen et al. 2023): draft ``x`` at row ``i`` is accepted with probability
``min(1, p(x) / q(x))``; on rejection the token is drawn from ``norm(max(0, p - q))`` and the run ends;
if all drafts are accepted a bonus token is drawn from row ``K``. Each emitted token is then distributed
exactly as ``p``. For an n-gram drafter ``q`` is a point mass on ``x`` (the draft is deterministic), so
the test becomes "accept with probability ``p(x)``" and the residual is ``p`` with ``x`` removed and
renormalised. ``p`` here is the distribution the ordinary sampler draws from (temperature, top-k, top-p
applied: ``sampler.sampling_probs``), so speculation changes nothing a client can observe except speed.
A seeded request's draws come from its own generator (so it is reproducible), but not the same draws
as without speculation.

Pure functions over tensors; the random source is passed in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def verify_greedy(target_logits: torch.Tensor, draft_token_ids: Sequence[int]) -> list[int]:
    """``target_logits`` ``[K + 1, V]``: the accepted drafts, then the target's argmax after them."""
    k = len(draft_token_ids)
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"{target_logits.shape[0]} logit rows for {k} draft tokens (expected {k + 1})")
    best: list[int] = target_logits.float().argmax(dim=-1).tolist()
    out: list[int] = []
    for i, draft in enumerate(draft_token_ids):
        out.append(best[i])
        if best[i] != draft:
            return out
    out.append(best[k])
    return out


def verify_random(
    target_probs: torch.Tensor,
    draft_token_ids: Sequence[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[int]:
    """Rejection sampling. ``target_probs`` ``[K + 1, V]`` (rows sum to 1); ``draft_probs`` ``[K, V]``, the
    distributions the drafts were sampled from, or None for a deterministic drafter (point masses).
    ``generator`` None draws from torch's default generator."""
    k = len(draft_token_ids)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"{target_probs.shape[0]} probability rows for {k} draft tokens (expected {k + 1})")
    if draft_probs is not None and draft_probs.shape[0] < k:
        raise ValueError(f"{draft_probs.shape[0]} draft distributions for {k} draft tokens")
    device = target_probs.device
    uniforms = torch.rand(k, generator=generator, device=device).tolist() if k else []
    out: list[int] = []
    for i, x in enumerate(draft_token_ids):
        p = target_probs[i]
        p_x = float(p[x])
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        # u < p/q with u ~ U[0, 1) has probability min(1, p/q); written without the division.
        if uniforms[i] * q_x < p_x:
            out.append(x)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min_(0.0)
        if not float(residual.sum()) > 0.0:
            # p <= q everywhere means p == q, where a rejection has probability 0; float rounding can
            # still get here, and p itself is then the right distribution.
            residual = p
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return out
