"""The admin link, JSON on the wire: auth check, config changed, accounting SQL and costs, identity rows.

These payloads are JSON (not msgpack) because people read them: ``nats req llm.v1.accounting.sql``, the
``llmgw sql`` client, the stored ``llm_identity`` bucket rows. Encode with :func:`proto.codec.encode_json`,
decode with :func:`proto.codec.decode_json`. Replies that are messages (``Message``) leave their
unset fields off the wire (``{"ok": false}``); the costs report and identity rows are
documents (``Document``) and write every field, nulls included.
"""

from __future__ import annotations

from typing import Any

import msgspec

from proto.base import Document, Message

# ---- llm.v1.auth.check: any service → the gateways ------------------------------------------------------


class AuthCheck(Message, frozen=True):
    """Is the API key with this SHA-256 (hex) valid, and whose? Only the digest crosses the bus."""

    key_sha256: str


class AuthReply(Message, frozen=True):
    """``ok`` False: unknown, expired or revoked (the other fields unset). ``role`` is "admin" or "user"."""

    ok: bool
    role: str | None = None
    key_id: str | None = None
    user: str | None = None


# ---- llm.v1.config.changed: a gateway → the gateways, telemetry, accounting -----------------------------


class ConfigChanged(Message, frozen=True):
    """A gateway saved its pools file: ``config`` is the file form, as saved (each reader validates it)."""

    gateway_id: str
    config: dict[str, Any]


# ---- llm.v1.gwmetrics.<group>: one gateway's workers → each other ----------------------------------------


class WorkerMetrics(Message, frozen=True):
    """A gateway worker's answer to an (empty) request on ``gateway_metrics(group)``: its label (``w0`` …)
    and its own /metrics text, which the asking worker merges into one answer (services/gateway/worker_metrics.py)."""

    worker: str
    text: str


# ---- llm.v1.accounting.sql: llmgw sql, tests → accounting --------------------------------------------


class SqlQuery(Message, frozen=True):
    """One read-only operator query, or (``export_parquet``) a Parquet export of the ledger."""

    sql: str | None = None
    export_parquet: bool = False


class SqlReply(Message, frozen=True):
    """Exactly one of: ``columns`` and ``rows`` (JSON values, as ``store.jsonable`` writes them), ``files``
    (the Parquet export), ``error`` (why the query was refused or failed)."""

    columns: list[str] | None = None
    rows: list[list[Any]] | None = None
    files: list[str] | None = None
    error: str | None = None


# ---- llm.v1.accounting.costs: the gateway's admin pages → accounting ----------------------------------


class CostsQuery(Message, frozen=True):
    """The window: ``days`` UTC days ending today (1..366, checked by accounting)."""

    days: int = 30


class ErrorDetail(Document, frozen=True):
    """The OpenAI error fields (services/common/http.py error_body)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorReply(Document, frozen=True):
    """A request/reply subject's refusal, shaped as the OpenAI error body ``{"error": {...}}``."""

    error: ErrorDetail


class CostFigures(Document, frozen=True):
    """One group's figures (docs/accounting.md, "Costs API"). None is unknown, never 0: ``kwh`` is measured
    energy only, ``estimated_kwh`` is never added into it; ``coverage_pct`` None when nothing could be covered."""

    requests: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    kwh: float | None = None
    energy_usd: float | None = None
    estimated_kwh: float | None = None
    list_value_usd: float | None = None
    j_per_output_token: float | None = None
    methods: list[str] = []
    coverage_pct: float | None = None


class DayCosts(CostFigures, frozen=True, kw_only=True):
    day: str  # UTC "YYYY-MM-DD"


class WindowCosts(CostFigures, frozen=True, kw_only=True):
    from_day: str = msgspec.field(name="from")  # UTC "YYYY-MM-DD", the window's first day
    to_day: str = msgspec.field(name="to")  # its last day (today)


class ModelCosts(CostFigures, frozen=True, kw_only=True):
    model: str | None


class MemberCosts(CostFigures, frozen=True, kw_only=True):
    member: str | None  # the worker id


class KeyCosts(CostFigures, frozen=True, kw_only=True):
    api_key_id: str | None  # None: requests without a key (trusted network)


class CostsReport(Document, frozen=True):
    """The costs document (services/accounting/costs.py builds it; services/gateway/charts.py reads it).

    Groups are ordered largest energy cost first, then most output tokens.
    """

    generated_at: str  # ISO 8601, UTC
    days: int
    rate_usd_per_kwh: float | None
    today: DayCosts
    window: WindowCosts
    daily: list[DayCosts]  # oldest first, one per day of the window
    by_model: list[ModelCosts]
    by_member: list[MemberCosts]
    by_api_key: list[KeyCosts]
    note: str = ""


# ---- the llm_identity KV bucket: one entry per row, written and read by every gateway -------------------
# Field names are the SQLite columns (services/gateway/identity.py REPLICATED), primary key first.


class UserRow(Document, frozen=True):
    user_id: str
    name: str
    role: str  # "admin" | "user" (checked by IdentityStore.apply_replica)
    pw_hash: str
    created_s: float
    updated_s: float
    disabled_s: float | None = None  # set: no sign-in, keys refused (absent from gateways before user management)
    deleted_s: float | None = None  # set: a deleted user's tombstone


class ApiKeyRow(Document, frozen=True):
    key_id: str
    user_id: str
    name: str
    key_sha256: str
    hint: str
    daily_quota: int | None
    created_s: float
    expires_s: float | None
    revoked_s: float | None
    replaced_by: str | None
    updated_s: float


class LimitsRow(Document, frozen=True):
    principal: str
    tokens_per_day: int | None
    requests_per_minute: int | None
    tokens_per_minute: int | None
    usd_per_month: float | None
    kwh_per_month: float | None
    updated_s: float


IDENTITY_ROWS: dict[str, type[UserRow | ApiKeyRow | LimitsRow]] = {
    "users": UserRow, "api_keys": ApiKeyRow, "limits": LimitsRow,
}
