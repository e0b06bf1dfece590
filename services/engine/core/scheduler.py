"""Which tokens of which requests the next forward step computes (vLLM v1's scheduler, simplified).

Each step has one token budget (``max_num_batched_tokens``) shared by decodes and chunked prefills; there
is no separate prefill phase. A request only has ``num_computed_tokens`` (tokens whose KV is in the
cache) and ``num_tokens`` (prompt + output); each step computes some of the gap.

``schedule()``:

1. **Running requests, oldest first.** Each gets ``num_tokens - num_computed_tokens`` tokens (1 for a
   decode; a prefill chunk, capped by ``long_prefill_token_threshold`` and the remaining budget).
   When the pool cannot give it the blocks, the *newest* running request is preempted (its blocks freed,
   ``num_computed_tokens`` reset to 0, put at the front of the waiting queue; its tokens, outputs
   included, are recomputed on re-admission, mostly from the prefix cache) and the allocation retried.
   If the request itself is the newest, it is the one preempted.
2. **Waiting requests, FIFO**, while lanes (``max_concurrency``), budget and blocks allow and no request
   was preempted this step (admitting one would just take the blocks the preempted one needs). A
   request's cached prefix (full blocks) is taken from the prefix cache and not recomputed. The head of
   the queue blocks the rest: no overtaking, so a large request is not starved.

``update_from_output()`` advances progress, appends sampled tokens, and finishes requests on
``max_tokens`` ("length") or an EOS / stop token id ("stop"). Stop *strings* need detokenized text, so
the caller checks them and calls :meth:`Scheduler.finish_request`.

**Speculative decoding.** A running request that is caught up (only its last sampled token lacks KV)
may carry draft tokens in ``Request.spec_token_ids`` (the engine core proposes them). It is then
scheduled as a small *extend*: the last token plus the drafts, ``1 + K`` positions in one forward, with
logits at every position (``ScheduledSeq.num_draft_tokens``). The drafts take budget and blocks like
any token, but never at the price of a preemption: when the blocks do not suffice, the drafts are
dropped and the request decodes one token as usual. ``update_from_output()`` then receives the run of
tokens the verification accepted (``accepted``): they are appended one by one with the same stop checks
as sampled tokens (a run is cut at EOS / ``max_tokens``), ``num_computed_tokens`` advances only over
the positions whose K/V belong to accepted tokens, and the blocks that held only rejected positions are
released (:meth:`BlockPool.free_unused_blocks`), so rejected drafts leave nothing behind: not in the
block table, not in a prefix-cache digest (registration happens after the rollback and only covers
computed positions).

The scheduler never touches tensors and never reads a clock: times come in as ``now`` arguments.
Admission limits: a request is refused at :meth:`Scheduler.add_request` when it could never run to
completion alone (``prompt + max_tokens`` beyond ``max_context`` or beyond the whole KV cache), which is
what guarantees progress: the oldest running request is never preempted, and it always fits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.engine.core.block_pool import BlockPool, HashFn, hash_block_tokens, prefix_hit_rate
from services.engine.core.request import Request, RequestStatus
from services.engine.core.sampling_params import SamplingParams
from services.engine.errors import (
    ContextLengthExceededError,
    DuplicateRequestError,
    InvalidParameterError,
    QueueFullError,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """Limits of one engine's scheduler. Validated on construction; a bad value names its field.

    - ``max_num_batched_tokens``: token budget of one forward step (prefill chunks + decodes).
    - ``max_concurrency``: lanes, the most requests running (holding KV blocks) at once.
    - ``max_pending_requests``: the waiting queue's bound; a full queue refuses with QueueFullError.
    - ``max_context``: per-request limit on ``prompt tokens + max_tokens``.
    - ``block_size`` (tokens per KV block), ``num_blocks`` (physical blocks, block 0 reserved as null).
    - ``long_prefill_token_threshold``: cap on one prefill chunk, so a long prompt cannot take the whole
      budget of a step from other prefills; None = only the budget caps it.
    - ``queue_full_retry_after_s``: the Retry-After hint carried by QueueFullError.
    """

    max_num_batched_tokens: int
    max_concurrency: int
    max_pending_requests: int
    max_context: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int | None = None
    queue_full_retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_concurrency", "max_context", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_pending_requests < 0:
            raise ValueError(f"max_pending_requests must be >= 0, got {self.max_pending_requests}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 1 or None, got {self.long_prefill_token_threshold}"
            )
        if self.queue_full_retry_after_s < 0:
            raise ValueError(f"queue_full_retry_after_s must be >= 0, got {self.queue_full_retry_after_s}")


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One request's work in a step: compute KV for ``token_ids`` at positions ``start_pos ...``.

    ``block_table`` is the request's physical block ids in sequence order after this step's allocation,
    long enough for ``start_pos + len(token_ids)`` tokens. ``needs_logits`` is True when the chunk ends
    at the last known token, i.e. the step must return logits for its last position and a token is
    sampled for the request; False for a prefill chunk that is not the last.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    needs_logits: bool
    # Speculative decoding: the last ``num_draft_tokens`` of ``token_ids`` are unverified drafts that
    # follow the request's last sampled token; the step returns logits for all 1 + num_draft_tokens
    # positions (needs_logits is then True).
    num_draft_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """The plan of one step. ``scheduled`` is in scheduling order (running first, then new admissions).

    ``preempted_ids``: requests that lost their blocks this step (a runner drops any per-request state).
    Token counts: ``num_decode_tokens`` counts one-token steps of requests that already have output and
    are caught up; everything else (prompt chunks, recomputation after preemption) is prefill.
    """

    scheduled: tuple[ScheduledSeq, ...]
    preempted_ids: tuple[str, ...]
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_admitted: int
    # Draft tokens scheduled for verification (part of num_scheduled_tokens, not of the two above: a
    # speculative decode counts 1 decode token, like a plain one).
    num_draft_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot for telemetry. Totals (``*_total``, prompt tokens) count since start."""

    num_running: int
    num_waiting: int
    num_prefilling: int
    num_decoding: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    kv_usage: float
    num_preemptions_total: int
    num_evictions_total: int
    num_prompt_tokens_queried: int
    num_prompt_tokens_hit: int

    @property
    def prefix_hit_rate(self) -> float:
        return prefix_hit_rate(self.num_prompt_tokens_hit, self.num_prompt_tokens_queried)


def _stop_reason(
    params: SamplingParams, eos_token_ids: frozenset[int], token_id: int, num_output_tokens: int
) -> str | None:
    """Why appending ``token_id`` (making ``num_output_tokens`` outputs) finishes a request, or None."""
    # Stop is checked before length: when the last allowed token is EOS the model did stop, and
    # "stop" tells the client more than "length" would.
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return "stop"
    if num_output_tokens >= params.max_tokens:
        return "length"
    return None


_FINISH_STATUS = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
}


class Scheduler:
    """Admission, per-step token planning, preemption and stop-by-token. One thread owns it."""

    def __init__(self, config: SchedulerConfig, hash_fn: HashFn = hash_block_tokens) -> None:
        """``hash_fn`` is the prefix cache's block digest; tests pass a weak one to force collisions."""
        self.config = config
        self.block_pool = BlockPool(
            config.num_blocks, config.block_size, enable_caching=config.enable_prefix_caching, hash_fn=hash_fn
        )
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # admission order: index 0 is the oldest
        self._requests: dict[str, Request] = {}  # every waiting or running request
        self.num_preemptions = 0
        # Capacity of the whole KV cache in tokens: a request that needs more could never finish.
        self._kv_capacity_tokens = self.block_pool.num_total_blocks * config.block_size

    # ---- intake -------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING).

        Raises InvalidParameterError (bad sampling params, empty prompt), ContextLengthExceededError
        (``prompt + max_tokens`` over ``max_context`` or over the KV cache), DuplicateRequestError,
        QueueFullError (``max_pending_requests`` wait beyond the free lanes; preempted requests count).
        """
        params = request.sampling_params.validate()
        if request.num_prompt_tokens == 0:
            raise InvalidParameterError("prompt", "", "the prompt must have at least one token")
        num_prompt = request.num_prompt_tokens
        total = num_prompt + params.max_tokens
        if total > self.config.max_context:
            raise ContextLengthExceededError(num_prompt, params.max_tokens, self.config.max_context)
        # The last sampled token never needs KV, hence total - 1 slots.
        if total - 1 > self._kv_capacity_tokens:
            raise ContextLengthExceededError(num_prompt, params.max_tokens, self._kv_capacity_tokens + 1)
        if request.request_id in self._requests:
            raise DuplicateRequestError(request.request_id)
        # A waiting request that a free lane will take at the next step is not pending: only those beyond the
        # free lanes count against the bound, so max_concurrency + max_pending_requests arriving together are
        # all accepted (issue #30: with 2 lanes + 2 pending, a burst of 12 was served 3 and refused 9 while
        # lanes were free).
        free_lanes = max(0, self.config.max_concurrency - len(self._running))
        pending = max(0, len(self._waiting) - free_lanes)
        if pending >= self.config.max_pending_requests:
            raise QueueFullError(pending, self.config.max_pending_requests, self.config.queue_full_retry_after_s)
        request.status = RequestStatus.WAITING
        self._waiting.append(request)
        self._requests[request.request_id] = request

    # ---- planning -----------------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """Plan the next step. ``now`` (seconds) stamps ``first_scheduled_s`` on newly admitted requests."""
        cfg = self.config
        pool = self.block_pool
        budget = cfg.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[str] = []
        num_prefill = num_decode = num_drafts = 0

        i = 0
        while i < len(self._running) and budget > 0:
            req = self._running[i]
            num_new = self._chunk_size(req.num_tokens - req.num_computed_tokens, budget)
            if num_new == 0:
                i += 1
                continue
            if req.spec_token_ids and req.num_tokens - req.num_computed_tokens == 1:
                num_spec = min(len(req.spec_token_ids), budget - 1)
                if num_spec > 0 and pool.allocate_slots(req, 1 + num_spec):
                    seq = self._make_seq(req, 1 + num_spec, num_spec)
                    req.spec_token_ids = []
                    scheduled.append(seq)
                    budget -= 1 + num_spec
                    num_decode += 1
                    num_drafts += num_spec
                    i += 1
                    continue
                req.spec_token_ids = []  # no budget or blocks for the drafts: a plain decode, no preemption
            while not pool.allocate_slots(req, num_new):
                victim = self._running.pop()  # the newest; index > i unless it is req itself
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req preempted itself: nothing newer is left running
            seq = self._make_seq(req, num_new)
            scheduled.append(seq)
            budget -= num_new
            if self._is_decode(req, seq):
                num_decode += num_new
            else:
                num_prefill += num_new
            i += 1

        num_admitted = 0
        while self._waiting and budget > 0 and len(self._running) < cfg.max_concurrency and not preempted:
            req = self._waiting[0]
            if cfg.enable_prefix_caching:
                computed, num_cached = pool.get_computed_blocks(req.all_token_ids)
            else:
                computed, num_cached = [], 0
            num_new = self._chunk_size(req.num_tokens - num_cached, budget)
            if not pool.allocate_slots(req, num_new, computed):
                break
            self._waiting.popleft()
            self._running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            if req.num_cached_prompt_tokens is None:
                req.num_cached_prompt_tokens = min(num_cached, req.num_prompt_tokens)
                if cfg.enable_prefix_caching:
                    pool.record_prefix_lookup(req.num_prompt_tokens, req.num_cached_prompt_tokens)
            if req.first_scheduled_s is None and now is not None:
                req.first_scheduled_s = now
            scheduled.append(self._make_seq(req, num_new))
            budget -= num_new
            num_prefill += num_new
            num_admitted += 1

        return SchedulerOutput(
            scheduled=tuple(scheduled),
            preempted_ids=tuple(preempted),
            num_scheduled_tokens=cfg.max_num_batched_tokens - budget,
            num_prefill_tokens=num_prefill,
            num_decode_tokens=num_decode,
            num_admitted=num_admitted,
            num_draft_tokens=num_drafts,
        )

    def _chunk_size(self, num_remaining: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold is not None and num_remaining > 1:
            num_remaining = min(num_remaining, threshold)
        return min(num_remaining, budget)

    @staticmethod
    def _make_seq(req: Request, num_new: int, num_spec: int = 0) -> ScheduledSeq:
        start = req.num_computed_tokens
        end = start + num_new - num_spec
        token_ids = tuple(req.all_token_ids[start:end])
        if num_spec:
            token_ids += tuple(req.spec_token_ids[:num_spec])
        return ScheduledSeq(
            request_id=req.request_id,
            token_ids=token_ids,
            start_pos=start,
            block_table=tuple(req.block_ids),
            needs_logits=end == req.num_tokens,
            num_draft_tokens=num_spec,
        )

    @staticmethod
    def _is_decode(req: Request, seq: ScheduledSeq) -> bool:
        return seq.num_tokens == 1 and req.num_output_tokens > 0 and seq.start_pos == req.num_tokens - 1

    def _preempt(self, req: Request) -> None:
        self.block_pool.free(req)
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(req)

    # ---- results ------------------------------------------------------------------------------------

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: Mapping[str, int],
        now: float,
        accepted: Mapping[str, Sequence[int]] | None = None,
    ) -> list[Request]:
        """Apply a finished step: ``sampled`` maps request id -> token for every seq with needs_logits
        and no draft tokens; ``accepted`` maps request id -> the verified run (1 .. 1 + K tokens: the
        accepted drafts, then the token sampled where verification stopped) for every seq with drafts.

        Returns the requests this step touched, in scheduling order; finished ones have a terminal status,
        ``finished_s = now`` and no blocks, and are no longer known to the scheduler. Seqs of requests
        aborted since ``schedule()`` are skipped.
        """
        pool = self.block_pool
        updated: list[Request] = []
        for seq in output.scheduled:
            req = self._requests.get(seq.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            assert req.num_computed_tokens == seq.start_pos, (req, seq)
            if seq.num_draft_tokens:
                assert accepted is not None, "a step with draft tokens needs its accepted runs"
                self._apply_accepted(req, seq, accepted[seq.request_id], now)
                updated.append(req)
                continue
            req.num_computed_tokens += seq.num_tokens
            pool.cache_full_blocks(req)
            if seq.needs_logits:
                token_id = sampled[seq.request_id]
                req.append_output_token(token_id)
                if req.first_token_s is None:
                    req.first_token_s = now
                reason = self._check_stop(req, token_id)
                if reason is not None:
                    self._finish(req, _FINISH_STATUS[reason], now)
            updated.append(req)
        return updated

    def _apply_accepted(self, req: Request, seq: ScheduledSeq, tokens: Sequence[int], now: float) -> None:
        """Append a verified run, cut at the first stop; roll the KV back to the accepted point."""
        if not 1 <= len(tokens) <= seq.num_draft_tokens + 1:
            raise ValueError(f"{req.request_id}: {len(tokens)} accepted tokens for {seq.num_draft_tokens} drafts")
        reason = None
        for token_id in tokens:
            req.append_output_token(token_id)
            reason = self._check_stop(req, token_id)
            if reason is not None:
                break
        # K/V is valid for the last known token and the drafts that were accepted: ``start + appended``
        # positions. The token appended last (sampled where verification stopped) has none yet.
        num_appended = req.num_tokens - seq.start_pos - 1
        req.num_computed_tokens = seq.start_pos + num_appended
        self.block_pool.free_unused_blocks(req)
        self.block_pool.cache_full_blocks(req)
        if req.first_token_s is None:
            req.first_token_s = now
        if reason is not None:
            self._finish(req, _FINISH_STATUS[reason], now)

    @staticmethod
    def num_tokens_until_stop(req: Request, token_ids: Sequence[int]) -> tuple[int, str | None]:
        """How many of ``token_ids``, appended in order to ``req``, survive the EOS / stop-token /
        ``max_tokens`` checks, and the finish reason the last of them triggers (None if none does).
        Pure: the request is not changed. The same rule :meth:`update_from_output` applies."""
        params = req.sampling_params
        num_output = req.num_output_tokens
        for i, token_id in enumerate(token_ids):
            reason = _stop_reason(params, req.eos_token_ids, token_id, num_output + i + 1)
            if reason is not None:
                return i + 1, reason
        return len(token_ids), None

    @staticmethod
    def _check_stop(req: Request, token_id: int) -> str | None:
        return _stop_reason(req.sampling_params, req.eos_token_ids, token_id, req.num_output_tokens)

    def finish_request(self, request_id: str, reason: str, now: float | None = None) -> Request | None:
        """Finish a waiting or running request from outside ("stop" | "length" | "abort").

        For stop strings (found by the detokenizing caller) and client disconnects. Frees its blocks.
        Idempotent: returns None when the request is unknown or already finished.
        """
        status = _FINISH_STATUS.get(reason)
        if status is None:
            raise ValueError(f"reason must be one of {sorted(_FINISH_STATUS)}, got {reason!r}")
        req = self._requests.get(request_id)
        if req is None:
            return None
        self._finish(req, status, now)
        return req

    def abort_request(self, request_id: str, now: float | None = None) -> Request | None:
        """Abort in any state (waiting, running, preempted); frees blocks; idempotent (None if unknown)."""
        return self.finish_request(request_id, "abort", now)

    def _finish(self, req: Request, status: RequestStatus, now: float | None) -> None:
        if req.status is RequestStatus.RUNNING:
            self._running.remove(req)
        else:
            self._waiting.remove(req)  # WAITING or PREEMPTED
        self.block_pool.free(req)
        req.status = status
        req.finished_s = now
        del self._requests[req.request_id]

    # ---- views --------------------------------------------------------------------------------------

    def get_request(self, request_id: str) -> Request | None:
        """The waiting or running request with this id, or None."""
        return self._requests.get(request_id)

    @property
    def running(self) -> tuple[Request, ...]:
        """Running requests, oldest first."""
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[Request, ...]:
        """Waiting requests in admission order (preempted ones at the front)."""
        return tuple(self._waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def stats(self) -> SchedulerStats:
        pool = self.block_pool
        num_decoding = sum(
            1 for r in self._running if r.num_output_tokens > 0 and r.num_computed_tokens == r.num_tokens - 1
        )
        return SchedulerStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_prefilling=len(self._running) - num_decoding,
            num_decoding=num_decoding,
            num_kv_blocks_used=pool.num_used_blocks,
            num_kv_blocks_total=pool.num_total_blocks,
            kv_usage=pool.usage,
            num_preemptions_total=self.num_preemptions,
            num_evictions_total=pool.num_evictions,
            num_prompt_tokens_queried=pool.num_prompt_tokens_queried,
            num_prompt_tokens_hit=pool.num_prompt_tokens_hit,
        )
