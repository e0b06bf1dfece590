"""The Speculator: the one interface the engine core calls to verify scheduled drafts and propose new ones.

The core calls three things per step: :meth:`Speculator.verify` for each request whose drafts were in the
step (the accepted drafts and the target's next token), then :meth:`Speculator.propose` once after the
step (drafts for every caught-up running request), and :attr:`Speculator.needs_hidden` tells it whether
the runner must return the target's hidden states (``--spec mtp``). Which proposer drafts is this module's
business: each is a :class:`Proposer` (:class:`NgramProposer`, :class:`DraftModelSource` over the draft
model, :class:`MTPSource` over the MTP head); the core sees the same calls for all three.
Sampling, detokenizing and emitting stay in the core: nothing here imports it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from services.engine.core.request import Request, RequestStatus
from services.engine.core.scheduler import SchedulerOutput
from services.engine.model.kv_cache import KVCache, KVCacheDtype
from services.engine.model.model import CausalLM
from services.engine.model.model_config import ModelConfig
from services.engine.model.sampler import sampling_probs
from services.engine.model.tokenizer import Tokenizer
from services.engine.spec.draft_model import DraftModelProposer, DraftProposal, DraftTarget
from services.engine.spec.mtp_proposer import MTPProposer, MTPRows
from services.engine.spec.rejection_sampler import verify_greedy, verify_random
from services.engine.spec.spec_decode import SpecConfig, SpecDecodeCounters, propose_ngram

GeneratorOf = Callable[[str], torch.Generator | None]
GetRequest = Callable[[str], Request | None]


@dataclass(frozen=True)
class StepView:
    """What a proposer may read of the step just run: its plan, the target's hidden states (when the
    runner returned them), the scheduler's requests and each request's sampling generator."""

    plan: SchedulerOutput
    hidden: torch.Tensor | None
    get_request: GetRequest
    generator_of: GeneratorOf


class Proposer(Protocol):
    """One way to draft tokens: n-gram lookup, a draft model, the MTP head."""

    needs_hidden: bool  # propose() reads StepView.hidden

    def propose(self, wanted: Sequence[tuple[Request, int]], step: StepView) -> Mapping[str, DraftProposal]:
        """Drafts for ``(request, k)`` pairs (at most ``k`` each); a request left out gets none."""
        ...

    def release_except(self, live_request_ids: set[str]) -> None:
        """Forget every request not in ``live_request_ids`` (finished, aborted, preempted)."""
        ...

    def describe(self, config: SpecConfig) -> str:
        """What drafts, for the startup line (after the method and K)."""
        ...


class NgramProposer:
    """Prompt lookup (``--spec ngram``): drafts are what followed the latest earlier n-gram match."""

    needs_hidden = False

    def __init__(self, config: SpecConfig) -> None:
        self.config = config

    def propose(self, wanted: Sequence[tuple[Request, int]], step: StepView) -> Mapping[str, DraftProposal]:
        return {request.request_id: DraftProposal(
                    propose_ngram(request.all_token_ids, k, self.config.ngram_max, self.config.ngram_min), None)
                for request, k in wanted}

    def release_except(self, live_request_ids: set[str]) -> None:
        pass

    def describe(self, config: SpecConfig) -> str:
        return ""


class DraftModelSource:
    """A smaller draft model (``--spec draft``): :class:`DraftModelProposer` behind the Proposer interface."""

    needs_hidden = False

    def __init__(self, drafter: DraftModelProposer) -> None:
        self.drafter = drafter

    def propose(self, wanted: Sequence[tuple[Request, int]], step: StepView) -> Mapping[str, DraftProposal]:
        if not wanted:
            return {}
        return self.drafter.propose([
            DraftTarget(request.request_id, request.all_token_ids, k, request.sampling_params,
                        step.generator_of(request.request_id))
            for request, k in wanted
        ])

    def release_except(self, live_request_ids: set[str]) -> None:
        self.drafter.release_except(live_request_ids)

    def describe(self, config: SpecConfig) -> str:
        return (f" from {config.draft_model_path} ({self.drafter.num_params / 1e6:.1f}M params"
                f"{', target LM head' if config.lm_head_draft else ''})")


class MTPSource:
    """The checkpoint's MTP head (``--spec mtp``): :class:`MTPProposer` behind the Proposer interface."""

    needs_hidden = True

    def __init__(self, mtp: MTPProposer) -> None:
        self.mtp = mtp

    def propose(self, wanted: Sequence[tuple[Request, int]], step: StepView) -> Mapping[str, DraftProposal]:
        assert step.hidden is not None
        # Runs even when no request wants drafts: the MTP's K/V must cover every computed position.
        targets = {request.request_id: DraftTarget(request.request_id, request.all_token_ids, k,
                                                   request.sampling_params, step.generator_of(request.request_id))
                   for request, k in wanted}
        return self.mtp.propose(self._rows(step), targets)

    @staticmethod
    def _rows(step: StepView) -> list[MTPRows]:
        """Each still-running request's kept positions of this step (``start_pos`` up to its
        ``num_computed_tokens`` now: a rejected draft's position is not kept) with the token after each
        and the target's hidden state there; ``hidden``'s rows follow ``plan.scheduled``'s tokens."""
        assert step.hidden is not None
        rows: list[MTPRows] = []
        offset = 0
        for seq in step.plan.scheduled:
            request = step.get_request(seq.request_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                num_kept = request.num_computed_tokens - seq.start_pos
                if num_kept > 0:
                    first = seq.start_pos + 1
                    rows.append(MTPRows(seq.request_id, seq.start_pos,
                                        request.all_token_ids[first : first + num_kept],
                                        step.hidden[offset : offset + num_kept], tuple(request.block_ids)))
            offset += len(seq.token_ids)
        return rows

    def release_except(self, live_request_ids: set[str]) -> None:
        pass

    def describe(self, config: SpecConfig) -> str:
        return (f" from the checkpoint's MTP module ({self.mtp.num_params / 1e6:.2f}M params, "
                f"main LM head, {math.ceil(self.mtp.kv_cache.nbytes / 2**20)} MiB KV)")


class Speculator:
    """Speculative decoding for one engine: the :class:`Proposer` its ``SpecConfig`` names, the counters,
    and the draft distributions of pending model drafts of sampled requests (for random verification)."""

    def __init__(self, config: SpecConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.counters = SpecDecodeCounters(config.method, config.num_draft_tokens)
        # Draft distributions of pending model drafts of sampled requests, by request id.
        self._draft_probs: dict[str, torch.Tensor] = {}

    @classmethod
    def build(cls, config: SpecConfig, *, model_path: Path, target: CausalLM, target_config: ModelConfig,
              target_tokenizer: Tokenizer, kv_cache: KVCache, block_size: int, max_concurrency: int,
              max_context: int, kv_dtype: KVCacheDtype, device: torch.device) -> Speculator | None:
        """The speculator ``config`` asks for (loading a draft model or the MTP head), or None when off."""
        if not config.is_enabled:
            return None
        proposer: Proposer
        if config.method == "draft":
            assert config.draft_model_path is not None  # validate() checked
            proposer = DraftModelSource(DraftModelProposer(
                Path(config.draft_model_path), target=target, target_config=target_config,
                target_tokenizer=target_tokenizer, num_draft_tokens=config.num_draft_tokens,
                num_target_blocks=kv_cache.num_blocks, block_size=block_size,
                max_concurrency=max_concurrency, max_context=max_context, kv_dtype=kv_dtype,
                lm_head_draft=config.lm_head_draft, device=device,
            ))
        elif config.method == "mtp":
            proposer = MTPSource(MTPProposer(
                Path(model_path), target=target, target_config=target_config,
                num_draft_tokens=config.num_draft_tokens, num_target_blocks=kv_cache.num_blocks,
                block_size=block_size, max_concurrency=max_concurrency, kv_dtype=kv_dtype,
                device=device,
            ))
        else:
            proposer = NgramProposer(config)
        return cls(config, proposer)

    @property
    def drafter(self) -> DraftModelProposer | None:
        return self.proposer.drafter if isinstance(self.proposer, DraftModelSource) else None

    @property
    def mtp(self) -> MTPProposer | None:
        return self.proposer.mtp if isinstance(self.proposer, MTPSource) else None

    @property
    def needs_hidden(self) -> bool:
        """Whether :meth:`propose` reads the step's target hidden states (the MTP head does)."""
        return self.proposer.needs_hidden

    def verify(self, request: Request, drafts: Sequence[int], logits: torch.Tensor,
               generator: torch.Generator | None) -> list[int]:
        """Accepted drafts + the target's next token for one request; updates the counters."""
        params = request.sampling_params
        draft_probs = self._draft_probs.pop(request.request_id, None)
        if params.is_greedy:
            tokens = verify_greedy(logits, drafts)
        else:
            q = None if draft_probs is None else draft_probs[: len(drafts)]
            tokens = verify_random(sampling_probs(logits, params), drafts, q, generator)
        self.counters.record(len(drafts), len(tokens) - 1)
        request.num_draft_tokens += len(drafts)
        request.num_accepted_draft_tokens += len(tokens) - 1
        return tokens

    def propose(self, plan: SchedulerOutput, hidden: torch.Tensor | None, running: Sequence[Request],
                get_request: GetRequest, generator_of: GeneratorOf) -> None:
        """Give every caught-up running request (one token short of its KV) drafts for the next step.
        ``hidden``: the step's target hidden states (``--spec mtp`` only), which the MTP reads."""
        spec = self.config
        live = {r.request_id for r in running}
        for rid in [r for r in self._draft_probs if r not in live]:
            del self._draft_probs[rid]
        self.proposer.release_except(live)
        wanted: list[tuple[Request, int]] = []
        for request in running:
            if request.spec_token_ids or request.num_output_tokens == 0:
                continue  # drafts still pending (not scheduled last step), or still prefilling
            if request.num_tokens - request.num_computed_tokens != 1:
                continue
            if not request.sampling_params.can_speculate:
                # verification compares against the plain target rows: requests with penalties, a logit
                # bias or a grammar (structured output) do not speculate
                continue
            # The step verifying k drafts may append k + 1 tokens: never plan past max_tokens.
            k = min(spec.num_draft_tokens, request.sampling_params.max_tokens - request.num_output_tokens - 1)
            if k > 0:
                wanted.append((request, k))
        proposals = self.proposer.propose(wanted, StepView(plan, hidden, get_request, generator_of))
        for request, _k in wanted:
            proposal = proposals.get(request.request_id)
            self._draft_probs.pop(request.request_id, None)
            if proposal is None:
                continue
            request.spec_token_ids = proposal.token_ids
            if proposal.probs is not None:
                self._draft_probs[request.request_id] = proposal.probs

    def describe(self) -> str:
        """The startup line's part about speculation."""
        spec = self.config
        return (f"; speculative decoding {spec.method}, {spec.num_draft_tokens} draft tokens"
                f"{self.proposer.describe(spec)}")
