"""What the engine hands out: RequestOutput (one request's step), its RequestTimings, and EngineSnapshot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.common.prom import Histogram
    from services.engine.core.scheduler import SchedulerStats
    from services.engine.model.sampler import TokenLogprobs
    from services.engine.spec.spec_decode import SpecDecodeStats


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Milliseconds, measured on the engine's monotonic clock, in vLLM's phases: ``queue_ms`` arrival to
    first scheduled (WAITING), ``prompt_ms`` first scheduled to first token (PREFILL), ``predicted_ms`` first
    token to the last (DECODE); the three add up to the request's time in the engine (e2e)."""

    queue_ms: float
    prompt_ms: float
    predicted_ms: float
    ttft_ms: float | None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one request produced in one step. ``text`` is the new text only (stop strings removed)."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    timings: RequestTimings | None = None
    # Speculative decoding, so far for this request: draft tokens proposed, and accepted by the target.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # One entry per token in ``token_ids`` when the request asked for logprobs, else None.
    logprobs: tuple[TokenLogprobs, ...] | None = None
    # The request's max_tokens sampling parameter (vllm:request_params_max_tokens); 0 where not known.
    max_tokens: int = 0
    # So far for this request: output tokens inside its <think> block, tags included (0 without thinking).
    num_reasoning_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What telemetry publishes: scheduler state, totals since start, throughput over a window."""

    stats: SchedulerStats
    lanes: int
    max_pending: int
    max_context: int
    kv_capacity_tokens: int
    admitted_total: int
    admitted_by_source: dict[str, int]
    prompt_tokens_total: int
    output_tokens_total: int
    prefill_tok_per_s: float
    decode_tok_per_s: float
    spec: SpecDecodeStats | None = None  # None when the engine does not speculate
    # Per step and per emission, since start (copies): tokens each step computed (vllm:iteration_tokens_total)
    # and the gaps between a request's consecutive token emissions (vllm:inter_token_latency_seconds).
    # None from a core that does not count them.
    iteration_tokens: Histogram | None = None
    inter_token_latency: Histogram | None = None
