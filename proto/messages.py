"""Message types that cross the bus.

Conventions (see docs/architecture.md):
- every message that a process emits repeatedly carries its origin id (``worker_id`` or
  ``gateway_id``), a process ``session_id`` (new at every start) and a monotonic ``seq`` so consumers
  can drop duplicates and see gaps;
- timestamps are UTC, float seconds since the Unix epoch (``*_s``); durations are ``*_ms``;
- a value the producer could not measure is ``None`` ("unavailable"), never a made-up 0.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PROTOCOL_VERSION = 1

EngineKind = Literal["native", "ninfer", "vllm", "llamacpp", "sglang", "stock"]
WorkerState = Literal["ready", "draining", "stopped", "down"]
FinishReason = Literal["stop", "length", "abort", "error"]
# "engine_reported": the engine's own figures (an NInfer-class /usage daily Wh), relayed by telemetry
EnergyMethod = Literal["counter", "power_integration", "estimated", "engine_reported", "unavailable"]


class _Msg(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Base: frozen, keyword-only, unknown fields ignored on decode."""


class ChatMessage(_Msg):
    role: str
    content: str = ""
    name: str | None = None


class GenerateRequest(_Msg):
    """gateway → engine on ``llm.v1.gen.<worker_id>``; replies stream to the message's reply inbox.

    Exactly one of ``messages`` (chat) and ``prompt`` (completion) is set. ``max_tokens`` None means
    "up to the context limit". ``deadline_s`` is the absolute UTC time after which the gateway has
    given up; the engine may abort work past it.
    """

    request_id: str
    model: str
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    gateway_id: str = ""
    api_key_id: str | None = None
    deadline_s: float | None = None
    protocol: int = PROTOCOL_VERSION
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0


class Usage(_Msg):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Timings(_Msg):
    """llama.cpp-style timings on the final chunk (milliseconds)."""

    prompt_n: int = 0
    cache_n: int = 0
    predicted_n: int = 0
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0
    queue_ms: float = 0.0
    ttft_ms: float | None = None
    # Speculative decoding (llama.cpp's names): draft tokens proposed for this request, and how many of
    # them the target model accepted. 0 when the engine does not speculate.
    draft_n: int = 0
    draft_n_accepted: int = 0


class ErrorInfo(_Msg):
    """The OpenAI error fields, carried on the bus so the gateway can answer with the right status."""

    message: str
    type: str = "server_error"
    code: str | None = None
    param: str | None = None
    status: int = 500
    retry_after_s: float | None = None


class TopLogprob(_Msg):
    """One of a position's most likely tokens: its text, log-probability and UTF-8 bytes (a byte-level
    token may be part of a character, so its text alone can be lossy)."""

    token: str
    logprob: float
    bytes: list[int] = []


class TokenLogprob(_Msg):
    """The chosen token at one output position, with the position's most likely tokens, best first."""

    token: str
    logprob: float
    bytes: list[int] = []
    top_logprobs: list[TopLogprob] = []


class TokenChunk(_Msg):
    """engine → gateway on the request's reply inbox, in order (``index`` counts from 0).

    The final chunk has ``finish_reason`` set and carries ``usage`` and ``timings``; an error ends the
    stream with ``error`` set (and ``finish_reason="error"``).
    """

    request_id: str
    index: int
    text: str = ""
    token_ids: list[int] = []
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: ErrorInfo | None = None
    worker_id: str = ""
    # One per entry of ``token_ids`` when the request asked for logprobs (GenerateRequest.logprobs).
    logprobs: list[TokenLogprob] | None = None

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class SlotHeartbeat(_Msg):
    """engine or telemetry → gateways on ``llm.v1.hb.<worker_id>`` and the ``llm_workers`` KV bucket.

    ``admitted_by_gateway`` counts, per gateway id, the requests the engine has accepted since
    ``session_id`` began, so each gateway books only the requests it routed that this heartbeat cannot
    yet reflect (``admitted_total`` is the sum over all gateways and direct HTTP clients).
    """

    worker_id: str
    session_id: str
    seq: int
    ts_s: float
    model_id: str
    engine_kind: EngineKind = "native"
    backend: str = ""
    state: WorkerState = "ready"
    lanes: int | None = None
    running: int | None = None
    waiting: int | None = None
    max_pending: int | None = None
    max_context: int | None = None
    kv_usage: float | None = None
    kv_blocks_used: int | None = None
    kv_blocks_total: int | None = None
    kv_spills_total: int | None = None
    kv_evictions_total: int | None = None
    preemptions_total: int | None = None
    admitted_total: int | None = None
    prompt_tokens_queried_total: int | None = None
    prompt_tokens_hit_total: int | None = None
    prefill_tok_per_s: float | None = None
    decode_tok_per_s: float | None = None
    energy_today_wh: float | None = None
    heartbeat_interval_s: float | None = None
    admitted_by_gateway: dict[str, int] = {}
    # Appended (a reader older than it ignores the key; a message older than it decodes as None): the
    # engine's own last-30-days figure (NInfer /usage ``energy.rolling_30d.wh``), None where not reported.
    energy_30d_wh: float | None = None
    # Appended: how many tokens the KV cache holds (blocks x block size), so a gateway can bound what its
    # cache-affinity table credits the engine with holding (docs/routing.md §4); None where unknown.
    kv_capacity_tokens: int | None = None


class EnergyReading(_Msg):
    """One device's raw cumulative counter at sample time. ``energy_mj`` None = unavailable."""

    device_id: str
    kind: Literal["nvml", "rapl", "engine", "estimate", "none"] = "none"
    method: EnergyMethod = "unavailable"
    energy_mj: int | None = None
    max_range_mj: int | None = None
    power_mw: int | None = None
    # Appended: the counter in its native unit where that is finer than mJ (RAPL's energy_uj and
    # max_energy_range_uj). A sender that has them still fills energy_mj/max_range_mj (= uj // 1000) for
    # older readers; a reader takes the µJ delta when both readings of an interval carry energy_uj.
    energy_uj: int | None = None
    max_range_uj: int | None = None


class RequestTokens(_Msg):
    request_id: str
    prompt_tokens: int = 0
    output_tokens: int = 0


class EnergySample(_Msg):
    """engine/telemetry → accounting on ``llm.v1.energy.<worker_id>`` (stream ``ENERGY``)."""

    worker_id: str
    session_id: str
    seq: int
    ts_s: float
    model_id: str
    readings: list[EnergyReading] = []
    request_tokens: list[RequestTokens] = []


class UsageRecord(_Msg):
    """gateway → accounting on ``llm.v1.usage.<gateway_id>`` (stream ``USAGE``), one per request."""

    gateway_id: str
    session_id: str
    seq: int
    ts_s: float
    request_id: str
    model: str
    pool: str
    member: str = ""
    worker_id: str = ""
    api_key_id: str | None = None
    endpoint: str = "chat.completions"
    stream: bool = False
    status: Literal["ok", "error", "aborted"] = "ok"
    http_status: int = 200
    finish_reason: str | None = None
    error_code: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_ms: float | None = None
    latency_ms: float = 0.0
    routing_reason: str = ""
    # Appended. Where the token counts come from (docs/accounting.md, "How usage is counted"):
    # "member" (the member's own final usage), "engine" (our engine's count at an abort),
    # "counted_by_gateway" (the gateway counted what it streamed: a cut-short HTTP member, a lost engine),
    # "none" (nothing was generated: refused before admission).
    usage_source: str = "member"
    # Appended. A 429 from a limit names it: tokens_per_day, requests_per_minute, tokens_per_minute,
    # usd_per_month, kwh_per_month, concurrent_requests; None otherwise.
    limit_kind: str | None = None
    # Appended: the user who owns ``api_key_id`` (limits bind the user; SQL can sum per user).
    user_id: str | None = None


class LimitCounters(_Msg):
    """gateway → gateways on ``llm.v1.quota.<gateway_id>``: what this gateway has counted against each
    limit in the current windows (settled usage plus open reservations), so a limit holds across replicas.

    ``counters`` maps ``"<principal>|<kind>|<window>"`` (e.g. ``"user:u_1|tokens_per_day|20812"``) to the
    amount (tokens, requests or US dollars). A receiver replaces the sender's previous message whole.
    """

    gateway_id: str
    session_id: str
    seq: int
    ts_s: float
    counters: dict[str, float] = {}


class KeyEnergyQuery(_Msg):
    """gateway → accounting (request/reply on ``llm.v1.accounting.key_energy``): month-to-date energy."""

    month: str  # "YYYY-MM", UTC


class KeyEnergyReply(_Msg):
    """The joules attributed to each API key's requests in ``month`` (measured intervals only; idle energy
    belongs to no key). ``as_of_s``: the newest interval end the figure covers."""

    month: str
    joules_by_key: dict[str, float] = {}
    as_of_s: float | None = None
