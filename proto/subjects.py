"""Subject, stream and bucket names: the only place they are spelled."""

from __future__ import annotations

import re

PREFIX = "llm.v1"

# Each name says the Struct it carries (msgpack unless "JSON": proto/admin.py's link).
STREAM_USAGE = "USAGE"  # USAGE_SUBJECTS
STREAM_ENERGY = "ENERGY"  # ENERGY_SUBJECTS
KV_WORKERS = "llm_workers"  # SlotHeartbeat per worker id: the last one, for a gateway starting up
# JSON UserRow / ApiKeyRow / LimitsRow per "users.<id>" / "api_keys.<id>" / "limits.<principal>", shared by
# the gateways (services/gateway/identity_sync.py)
KV_IDENTITY = "llm_identity"

USAGE_SUBJECTS = f"{PREFIX}.usage.>"  # UsageRecord, see usage()
ENERGY_SUBJECTS = f"{PREFIX}.energy.>"  # EnergySample, see energy()
HEARTBEAT_ALL = f"{PREFIX}.hb.*"  # SlotHeartbeat, see heartbeat()
ACCOUNTING_SQL = f"{PREFIX}.accounting.sql"  # request/reply, JSON: SqlQuery -> SqlReply
ACCOUNTING_KEY_ENERGY = f"{PREFIX}.accounting.key_energy"  # KeyEnergyQuery -> KeyEnergyReply (kWh limits)
# request/reply, JSON: CostsQuery -> CostsReport (or ErrorReply), for the admin pages
ACCOUNTING_COSTS = f"{PREFIX}.accounting.costs"
AUTH_CHECK = f"{PREFIX}.auth.check"  # request/reply to the gateways, JSON: AuthCheck -> AuthReply
QUOTA_ALL = f"{PREFIX}.quota.*"  # each gateway's LimitCounters (services/gateway/limits.py), see quota()
ROUTE_ALL = f"{PREFIX}.route.*"  # each gateway's RouteNotes (services/gateway/route_sharing.py), see route()
CONFIG_CHANGED = f"{PREFIX}.config.changed"  # JSON ConfigChanged: a gateway saved the pools file; replicas reload it
GATEWAY_METRICS_ALL = f"{PREFIX}.gwmetrics.*"  # request/reply among one gateway's workers, see gateway_metrics()

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def check_id(value: str) -> str:
    """A worker/gateway id must be one subject token and a valid KV key."""
    if not _TOKEN.match(value):
        raise ValueError(f"invalid id {value!r}: use 1-128 of [A-Za-z0-9_-]")
    return value


def gen(worker_id: str) -> str:
    """GenerateRequest; the TokenChunks stream back to the message's reply inbox."""
    return f"{PREFIX}.gen.{worker_id}"


def embed(worker_id: str) -> str:
    """EmbedRequest, request/reply: one EmbedReply comes back on the message's reply inbox."""
    return f"{PREFIX}.embed.{worker_id}"


def cancel(worker_id: str) -> str:
    """Cancel."""
    return f"{PREFIX}.cancel.{worker_id}"


def heartbeat(worker_id: str) -> str:
    """SlotHeartbeat."""
    return f"{PREFIX}.hb.{worker_id}"


def energy(worker_id: str) -> str:
    """EnergySample (stream ENERGY)."""
    return f"{PREFIX}.energy.{worker_id}"


def usage(gateway_id: str) -> str:
    """UsageRecord (stream USAGE)."""
    return f"{PREFIX}.usage.{gateway_id}"


def quota(gateway_id: str) -> str:
    """LimitCounters."""
    return f"{PREFIX}.quota.{gateway_id}"


def gateway_metrics(group: str) -> str:
    """Request/reply among the worker processes of one ``llmgw gateway --workers N``: an empty request;
    each worker answers with its own /metrics text (services/gateway/worker_metrics.py)."""
    return f"{PREFIX}.gwmetrics.{group}"


def route(gateway_id: str) -> str:
    """RouteNotes."""
    return f"{PREFIX}.route.{gateway_id}"
