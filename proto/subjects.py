"""Subject, stream and bucket names: the only place they are spelled."""

from __future__ import annotations

import re

PREFIX = "llm.v1"

STREAM_USAGE = "USAGE"
STREAM_ENERGY = "ENERGY"
KV_WORKERS = "llm_workers"
KV_IDENTITY = "llm_identity"  # users and API keys shared by the gateways (services/gateway/identity_sync.py)

USAGE_SUBJECTS = f"{PREFIX}.usage.>"
ENERGY_SUBJECTS = f"{PREFIX}.energy.>"
HEARTBEAT_ALL = f"{PREFIX}.hb.*"
ACCOUNTING_SQL = f"{PREFIX}.accounting.sql"
ACCOUNTING_KEY_ENERGY = f"{PREFIX}.accounting.key_energy"  # KeyEnergyQuery -> KeyEnergyReply (kWh limits)
ACCOUNTING_COSTS = f"{PREFIX}.accounting.costs"  # request/reply: the costs JSON for the admin pages
# request/reply to the gateways: {"key_sha256": hex} -> {"ok": bool, "role": "admin"|"user", "key_id", "user"}
AUTH_CHECK = f"{PREFIX}.auth.check"
QUOTA_ALL = f"{PREFIX}.quota.*"  # each gateway's LimitCounters (services/gateway/limits.py)
CONFIG_CHANGED = f"{PREFIX}.config.changed"  # a gateway saved the pools file; replicas reload it

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def check_id(value: str) -> str:
    """A worker/gateway id must be one subject token and a valid KV key."""
    if not _TOKEN.match(value):
        raise ValueError(f"invalid id {value!r}: use 1-128 of [A-Za-z0-9_-]")
    return value


def gen(worker_id: str) -> str:
    return f"{PREFIX}.gen.{worker_id}"


def cancel(worker_id: str) -> str:
    return f"{PREFIX}.cancel.{worker_id}"


def heartbeat(worker_id: str) -> str:
    return f"{PREFIX}.hb.{worker_id}"


def energy(worker_id: str) -> str:
    return f"{PREFIX}.energy.{worker_id}"


def usage(gateway_id: str) -> str:
    return f"{PREFIX}.usage.{gateway_id}"


def quota(gateway_id: str) -> str:
    return f"{PREFIX}.quota.{gateway_id}"
