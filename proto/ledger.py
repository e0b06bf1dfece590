"""The ledger's link: UsageRecord and EnergySample into accounting, key energy back, LimitCounters between gateways."""

from __future__ import annotations

from typing import Literal

from proto.base import Message
from proto.fleet import EnergyReading


class RequestTokens(Message, frozen=True):
    request_id: str
    prompt_tokens: int = 0
    output_tokens: int = 0


class EnergySample(Message, frozen=True):
    """engine/telemetry → accounting on ``llm.v1.energy.<worker_id>`` (stream ``ENERGY``)."""

    worker_id: str
    session_id: str
    seq: int
    ts_s: float
    model_id: str
    readings: list[EnergyReading] = []
    request_tokens: list[RequestTokens] = []


class UsageRecord(Message, frozen=True):
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


class LimitCounters(Message, frozen=True):
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


class KeyEnergyQuery(Message, frozen=True):
    """gateway → accounting (request/reply on ``llm.v1.accounting.key_energy``): month-to-date energy."""

    month: str  # "YYYY-MM", UTC


class KeyEnergyReply(Message, frozen=True):
    """The joules attributed to each API key's requests in ``month`` (measured intervals only; idle energy
    belongs to no key). ``as_of_s``: the newest interval end the figure covers."""

    month: str
    joules_by_key: dict[str, float] = {}
    as_of_s: float | None = None
