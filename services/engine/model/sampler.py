"""Turns a step's logits into one token per request (greedy, temperature, top-k, top-p, seeds).

Contract of :meth:`Sampler.sample`: row ``i`` of ``logits`` belongs to ``params[i]`` and
``generators[i]``, and the token drawn for row ``i`` depends only on that row, its params and its
generator, never on the other rows. So a seeded request (the caller keeps one ``torch.Generator`` per
request, seeded from ``SamplingParams.seed``, on the logits' device) yields the same tokens whatever
shares its batch. Rows whose generator is None draw from torch's default generator.

Random rows are sampled with the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. picks
index ``i`` with probability ``p_i`` (the argmin of ``E_i / p_i``, exponentials with rates ``p_i``), which
vectorises over rows and needs no cumulative sum or host sync. Greedy rows take ``argmax(logits)``.
Filtering order, as in HF transformers and vLLM: temperature, then top-k, then top-p over the
renormalised top-k distribution.

Logprobs, when a row asks for them, are ``log_softmax`` of the raw logits (before temperature and
filtering), as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.engine.core.sampling_params import SamplingParams
from services.engine.kernels import cpu_kernels

if TYPE_CHECKING:
    from services.engine.core.request import Request

# Smallest positive float32; keeps E > 0 so p / E never divides by zero (0 / 0 = NaN would win argmax).
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The sampled token's log-probability and the row's top-n ``(token_id, logprob)``, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class Sampler:
    """Stateless; one instance per engine. Works on any device the logits live on."""

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        histories: Sequence[History | None] | None = None,
    ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """Sample one token per row of ``logits`` ``[N, V]``.

        ``histories[i]`` is what row ``i``'s penalties and ``min_tokens`` need (see SamplingParams); None
        where a row has neither. Returns ``(token_ids, logprobs)``; ``logprobs`` is None when no row asked
        for them, else a list with None for the rows that did not.
        """
        n = logits.shape[0]
        if logits.dim() != 2 or len(params) != n or len(generators) != n:
            raise ValueError(
                f"logits {tuple(logits.shape)} must be [N, V] with N = len(params) = len(generators) "
                f"({len(params)}, {len(generators)})"
            )
        raw = logits = logits.float()
        if any(p.logit_bias for p in params):
            logits = apply_logit_bias(raw.clone(), params)
        if any(p.shapes_logits for p in params):
            logits = apply_penalties(logits.clone() if logits is raw else logits, params, histories)
        greedy = [p.is_greedy for p in params]
        sampled = argmax(logits)
        if not all(greedy):
            random_ids = self._sample_random(logits, params, generators, greedy)
            greedy_mask = torch.tensor(greedy, device=logits.device)
            sampled = torch.where(greedy_mask, sampled, random_ids)
        token_ids: list[int] = sampled.tolist()
        if not any(p.logprobs is not None for p in params):
            return token_ids, None
        return token_ids, self._logprobs(raw, params, sampled)

    def _sample_random(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        greedy: list[bool],
    ) -> torch.Tensor:
        device = logits.device
        # Greedy rows get temperature 1 here only to stay finite; their draw is discarded.
        temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                             device=device)
        scaled = logits / temps.unsqueeze(1)
        top_k = [0 if g else p.effective_top_k for p, g in zip(params, greedy, strict=True)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = torch.softmax(scaled, dim=-1)
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)]
        if any(m > 0.0 for m in min_p):
            probs = apply_min_p(probs, min_p)
        race = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None and not greedy[i]]
        if unseeded:
            race.exponential_()
        for i, gen in enumerate(generators):
            if gen is not None and not greedy[i]:
                # Row i's draw comes from its own generator only: independent of batch position.
                race[i].exponential_(generator=gen)
        return (probs / race.clamp_min_(_TINY)).argmax(dim=-1)

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, params: Sequence[SamplingParams], sampled: torch.Tensor
    ) -> list[TokenLogprobs | None]:
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        sampled_l = sampled.tolist()
        max_n = max(params[i].logprobs or 0 for i in rows)
        found = Sampler.token_logprobs(logits[rows], [sampled_l[i] for i in rows], max_n)
        out: list[TokenLogprobs | None] = [None] * len(params)
        for lp, i in zip(found, rows, strict=True):
            k = params[i].logprobs or 0
            out[i] = lp if k == max_n else TokenLogprobs(lp.token_id, lp.logprob, lp.top[:k])
        return out

    @staticmethod
    def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top_n: int) -> list[TokenLogprobs]:
        """Row ``i``'s log-probability of ``token_ids[i]`` and its ``top_n`` best ``(id, logprob)``: the
        model's own distribution (log-softmax of the raw logits, before temperature, top-k or top-p)."""
        if not token_ids:
            return []
        lp = torch.log_softmax(logits.float(), dim=-1)
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=lp.device)
        chosen = lp.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
        if top_n > 0:
            top_vals, top_ids = lp.topk(top_n, dim=-1)
            top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
        else:
            top_vals_l = top_ids_l = [[] for _ in token_ids]
        return [TokenLogprobs(token_id=t, logprob=c, top=tuple(zip(i, v, strict=True)))
                for t, c, i, v in zip(token_ids, chosen, top_ids_l, top_vals_l, strict=True)]


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of ``[N, V]`` float32 logits, by the compiled kernel on the CPU when it is
    loaded (same result: the first index of the largest value)."""
    kernel = cpu_kernels.argmax_rows
    if kernel is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.shape[1]:
        return kernel(logits)
    return logits.argmax(dim=-1)


@dataclass(frozen=True, slots=True)
class History:
    """A row's tokens so far, and the ids that end it (suppressed while ``min_tokens`` is not reached)."""

    prompt: Sequence[int]
    output: Sequence[int]
    stop_ids: Sequence[int] = ()


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    histories: Sequence[History | None] | None) -> torch.Tensor:
    """``min_tokens``'s ban on stop ids, then repetition, frequency and presence penalties, in place on
    the rows that have them."""
    for i, p in enumerate(params):
        if not p.shapes_logits:
            continue
        history = None if histories is None else histories[i]
        if history is None:
            raise ValueError(f"row {i} has penalties or min_tokens but no token history")
        prompt, output = history.prompt, history.output
        row = logits[i]
        if len(output) < p.min_tokens and history.stop_ids:
            row[torch.tensor(list(history.stop_ids), dtype=torch.long, device=logits.device)] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({*prompt, *output}), dtype=torch.long, device=logits.device)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if output and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
            ids, counts = torch.unique(torch.tensor(list(output), dtype=torch.long, device=logits.device),
                                       return_counts=True)
            row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
    return logits


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """OpenAI's ``logit_bias``: each row's ``(token_id, bias)`` pairs added to its logits, in place."""
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=logits.device)
            bias = torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype, device=logits.device)
            logits[i].index_add_(0, ids, bias)
    return logits


def apply_min_p(probs: torch.Tensor, min_p: Sequence[float]) -> torch.Tensor:
    """vLLM's min-p: in row ``i``, probabilities below ``min_p[i]`` times the row's largest are set to 0
    (the race in :meth:`Sampler._sample_random` needs no renormalisation). 0 is off; the top token stays."""
    threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, dtype=probs.dtype,
                                                                      device=probs.device).unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def apply_top_k_top_p(logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> torch.Tensor:
    """Set filtered-out logits to -inf, per row. ``top_k[i] == 0`` and ``top_p[i] == 1.0`` mean off.

    Top-k keeps exactly ``k`` tokens (ties broken by sort order). Top-p then keeps the minimal nucleus
    of the renormalised top-k distribution: token ``j`` (in descending order) stays iff the mass of the
    tokens before it is ``< p``, so the kept set is the shortest prefix whose mass reaches ``p``, and the
    most likely token always stays.
    """
    vocab = logits.shape[1]
    device = logits.device
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    positions = torch.arange(vocab, device=device).unsqueeze(0)
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(positions >= k, float("-inf"))
    p_rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if p_rows:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        p = torch.tensor(top_p, device=device, dtype=probs.dtype).unsqueeze(1)
        drop = mass_before >= p
        # Rows with top_p == 1 are untouched: float error could make the mass before a tail token
        # reach 1.0 and drop it.
        drop &= (p < 1.0)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution :meth:`Sampler.sample` draws from for a non-greedy request, as float32 probs:
    ``softmax(top_p(top_k(logits / temperature)))`` row by row over ``logits`` ``[N, V]`` (every row with
    the same ``params``). Speculative verification compares target and draft probabilities with it."""
    scaled = logits.float() / params.temperature
    n = scaled.shape[0]
    if params.effective_top_k > 0 or params.top_p < 1.0:
        scaled = apply_top_k_top_p(scaled, [params.effective_top_k] * n, [params.top_p] * n)
    return torch.softmax(scaled, dim=-1)


def logprobs_by_request(request_ids: Sequence[str], logprobs: Sequence[TokenLogprobs | None] | None
                ) -> dict[str, TokenLogprobs]:
    """The sampler's per-row logprobs keyed by the rows' request ids (the rows that asked only)."""
    if logprobs is None:
        return {}
    return {rid: lp for rid, lp in zip(request_ids, logprobs, strict=True) if lp is not None}


def histories(requests: Sequence[Request | None]) -> list[History | None] | None:
    """What the sampler's penalties and min_tokens need, per request; None when no request has any."""
    if not any(r is not None and r.sampling_params.shapes_logits for r in requests):
        return None
    return [history(r) if r.sampling_params.shapes_logits else None for r in requests if r is not None]


def history(request: Request) -> History:
    params = request.sampling_params
    stop_ids: tuple[int, ...] = ()
    if request.num_output_tokens < params.min_tokens:  # the only steps that suppress them
        eos_ids = () if params.ignore_eos else request.eos_token_ids
        stop_ids = tuple(sorted({*params.stop_token_ids, *eos_ids}))
    return History(request.prompt_token_ids, request.output_token_ids, stop_ids)
