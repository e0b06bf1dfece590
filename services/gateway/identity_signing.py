"""Signatures on the shared identity rows: a row in ``llm_identity`` counts only when a gateway of this fleet
wrote it.

The bus permissions (:mod:`services.common.nats_auth`) already keep engines, telemetry and accounting out of
the bucket; this is the second wall, for a bus without those permissions (an operator's own NATS cluster,
one shared user) or a credential that leaked. Each row's JSON carries ``sig``: HMAC-SHA256 with the fleet
secret over the bucket key and the row's other fields, serialised with sorted keys (so a gateway that
knows fewer or more fields than the writer checks the same bytes). The fleet secret is
``LLMGW_FLEET_SECRET`` (the same on every gateway of a multi-host fleet), else a random one made at the
first start in ``DATA/fleet.secret`` (mode 0600), enough for gateways sharing one data directory.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Any

import msgspec

from services.common.runtime import atomic_write_text

SECRET_FILE = "fleet.secret"
SIG_FIELD = "sig"


def fleet_secret(data: Path) -> bytes:
    """``LLMGW_FLEET_SECRET``, else ``data/fleet.secret`` (created on first use)."""
    env = os.environ.get("LLMGW_FLEET_SECRET", "").strip()
    if env:
        return env.encode()
    path = data / SECRET_FILE
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        text = ""
    if not text:
        text = secrets.token_urlsafe(32)
        atomic_write_text(path, text + "\n")  # mkstemp: mode 0600
    return text.encode()


def _digest(secret: bytes, key: str, fields: dict[str, Any]) -> str:
    body = {k: v for k, v in fields.items() if k != SIG_FIELD}
    message = key.encode() + b"\n" + msgspec.json.encode(body, order="sorted")
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def sign(secret: bytes, key: str, value: bytes) -> bytes:
    """``value`` (a row's JSON object) with its ``sig`` field set."""
    fields = msgspec.json.decode(value, type=dict[str, Any])
    fields[SIG_FIELD] = _digest(secret, key, fields)
    return msgspec.json.encode(fields)


def check(secret: bytes, key: str, value: bytes) -> str | None:
    """None when ``value`` carries a valid signature for ``key``; else why not ("missing", "bad", "malformed")."""
    try:
        fields = msgspec.json.decode(value, type=dict[str, Any])
    except msgspec.DecodeError:
        return "malformed"
    sig = fields.get(SIG_FIELD)
    if not isinstance(sig, str) or not sig:
        return "missing"
    return None if hmac.compare_digest(sig, _digest(secret, key, fields)) else "bad"
