"""Who may say what on the bus: one NATS user per role, with per-role subject permissions.

``llmgw up`` runs its embedded nats-server with the ``authorization`` block :func:`authorization_conf`
writes: one user per role (:data:`ROLES`), each with a generated password kept in
``DATA/nats/credentials.json`` (mode 0600) and only its bcrypt hash in the server's config file
(nats-server compares ``$2a$`` passwords with bcrypt: docs.nats.io, "Username/Password", bcrypted
passwords). A client without a user, or with a wrong password, is refused at CONNECT.

The subjects are the real ones of :mod:`proto.subjects` and of the services that use them:

========== ============================================== ===================================================
role       publishes                                      subscribes
========== ============================================== ===================================================
gateway    gen/cancel/embed to engines, usage, quota,    heartbeats, energy, auth.check, config,
           config, route notes, accounting requests,      quota, route notes, the identity bucket
           the identity bucket
engine     its own heartbeat, energy and workers-bucket   its own request, cancel and embed
           key, its streamed answers (inboxes)            subjects (``llmgw up``: one engine by id)
telemetry  heartbeats and energy for the members it        config changes
           scrapes, the workers bucket
accounting auth.check requests, acks of its pulls         accounting.sql/costs/key_energy, config changes
admin      everything (the operator's ``llmgw sql`` and   everything
           the nats CLI)
========== ============================================== ===================================================

Every role may use the JetStream API (``$JS.API.>``: stream info, KV reads, acked publishes) and
inboxes (``_INBOX.>``: request/reply), except that only ``gateway`` and ``admin`` may touch the
identity bucket ``llm_identity`` (its ``$KV.`` subjects and the JetStream API calls naming its
stream): an engine, telemetry or accounting user cannot write a user row, read one, purge or delete
the bucket. The gateway also checks a signature on every row (``services/gateway/identity_signing.py``),
so a row that reaches the bucket by another path is still ignored. No role but ``admin`` may delete or purge
a stream, delete a stored message, change a stream's limits (accounting excepted: it owns them) or delete
accounting's consumers (:data:`DESTRUCTIVE_JS_API`).
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from proto import subjects
from services.common.runtime import atomic_write_text

ROLES = ("gateway", "engine", "telemetry", "accounting", "admin")
CREDENTIALS_FILE = "credentials.json"
# bcrypt cost: the server hashes the offered password at every CONNECT (and reconnect); 10 rounds took
# 0.18 s per hash on the shared 2-core dev machine (measured, Python bcrypt 5.0), so `llmgw up` spends
# under a second writing the five hashes: slow for a guesser, cheap for five services that connect once.
BCRYPT_ROUNDS = 10

_P = subjects.PREFIX
_IDENTITY_STREAM = f"KV_{subjects.KV_IDENTITY}"
_WORKERS_KV = f"$KV.{subjects.KV_WORKERS}.>"
# The JetStream API calls that name the identity bucket's stream: $JS.API.STREAM.INFO.KV_llm_identity,
# $JS.API.STREAM.MSG.GET.KV_llm_identity, $JS.API.DIRECT.GET.KV_llm_identity.<subject>,
# $JS.API.CONSUMER.CREATE.KV_llm_identity.<name>.<filter> … (the stream's name is the 5th or 6th token).
IDENTITY_DENY = [
    f"$KV.{subjects.KV_IDENTITY}.>",
    f"$JS.API.*.*.{_IDENTITY_STREAM}", f"$JS.API.*.*.{_IDENTITY_STREAM}.>",
    f"$JS.API.*.*.*.{_IDENTITY_STREAM}", f"$JS.API.*.*.*.{_IDENTITY_STREAM}.>",
]
_COMMON_PUB = ["$JS.API.>", "_INBOX.>"]
_COMMON_SUB = ["_INBOX.>"]
# JetStream API calls that destroy or rewrite what the ledger and the fleet rely on: deleting or purging a
# stream, deleting a stored message, changing a stream's limits (``max_age: 1`` would expire the USAGE stream),
# snapshots and restores, cluster and account operations. Only ``admin`` (the operator) may; the services
# create what is missing and leave the rest to accounting, which owns the two streams' configuration
# (services/common/bus.py: ``ensure_bus(update=...)``), and to the operator.
DESTRUCTIVE_JS_API = [
    "$JS.API.STREAM.DELETE.>", "$JS.API.STREAM.PURGE.>", "$JS.API.STREAM.MSG.DELETE.>",
    "$JS.API.STREAM.SNAPSHOT.>", "$JS.API.STREAM.RESTORE.>", "$JS.API.STREAM.PEER.>",
    "$JS.API.STREAM.LEADER.>", "$JS.API.META.>", "$JS.API.ACCOUNT.>", "$JS.API.SERVER.>",
    f"$JS.API.CONSUMER.DELETE.{subjects.STREAM_USAGE}.>", f"$JS.API.CONSUMER.DELETE.{subjects.STREAM_ENERGY}.>",
]
_STREAM_UPDATE = "$JS.API.STREAM.UPDATE.>"


def _deny(*extra: str) -> list[str]:
    return [*DESTRUCTIVE_JS_API, *extra]


def engine_permissions(worker_id: str | None) -> dict[str, Any]:
    """An engine's permissions: with ``worker_id``, only its own subjects (its heartbeat, energy and workers-bucket
    key; its request, cancel and embed subjects), so an engine user cannot speak for another engine or take its
    requests; without one (a shared ``engine`` user for engines the config does not name), any engine's."""
    wid = subjects.check_id(worker_id) if worker_id is not None else "*"
    return {
        "publish": {"allow": [subjects.heartbeat(wid), subjects.energy(wid), f"$KV.{subjects.KV_WORKERS}.{wid}",
                              *_COMMON_PUB],
                    "deny": _deny(_STREAM_UPDATE, *IDENTITY_DENY)},
        "subscribe": {"allow": [subjects.gen(wid), subjects.cancel(wid), subjects.embed(wid), *_COMMON_SUB],
                      "deny": IDENTITY_DENY},
    }


PERMISSIONS: dict[str, dict[str, Any]] = {
    "gateway": {
        "publish": {"allow": [f"{_P}.gen.*", f"{_P}.cancel.*", f"{_P}.embed.*", subjects.USAGE_SUBJECTS,
                              subjects.QUOTA_ALL, subjects.GATEWAY_METRICS_ALL, subjects.ROUTE_ALL,
                              subjects.CONFIG_CHANGED, f"{_P}.accounting.>", f"$KV.{subjects.KV_IDENTITY}.>",
                              "$JS.ACK.>", "$JS.FC.>", *_COMMON_PUB],
                    "deny": _deny(_STREAM_UPDATE)},
        "subscribe": {"allow": [subjects.HEARTBEAT_ALL, subjects.AUTH_CHECK, subjects.CONFIG_CHANGED,
                                subjects.QUOTA_ALL, subjects.GATEWAY_METRICS_ALL, subjects.ROUTE_ALL,
                                subjects.ENERGY_SUBJECTS, f"$KV.{subjects.KV_IDENTITY}.>",
                                _WORKERS_KV, *_COMMON_SUB]},
    },
    "engine": engine_permissions(None),
    "telemetry": {
        "publish": {"allow": [subjects.HEARTBEAT_ALL, subjects.ENERGY_SUBJECTS, _WORKERS_KV, *_COMMON_PUB],
                    "deny": _deny(_STREAM_UPDATE, *IDENTITY_DENY)},
        "subscribe": {"allow": [subjects.CONFIG_CHANGED, *_COMMON_SUB], "deny": IDENTITY_DENY},
    },
    "accounting": {
        "publish": {"allow": [subjects.AUTH_CHECK, "$JS.ACK.>", *_COMMON_PUB], "deny": _deny(*IDENTITY_DENY)},
        "subscribe": {"allow": [f"{_P}.accounting.>", subjects.CONFIG_CHANGED, *_COMMON_SUB],
                      "deny": IDENTITY_DENY},
    },
    "admin": {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}},
}


def engine_user(worker_id: str) -> str:
    """The NATS user of one named engine in a generated config (``engine.<worker id>``)."""
    return f"engine.{subjects.check_id(worker_id)}"


def load_or_create_credentials(directory: Path) -> dict[str, str]:
    """The role → password map in ``directory/credentials.json``, created (0600) with a random password
    per role at the first start; a role missing from an older file gets one added."""
    path = directory / CREDENTIALS_FILE
    try:
        stored = json.loads(path.read_text())
        creds = {role: str(stored[role]) for role in ROLES if isinstance(stored.get(role), str)}
    except (OSError, ValueError, AttributeError):
        creds = {}
    if set(creds) != set(ROLES):
        creds = {role: creds.get(role) or secrets.token_urlsafe(24) for role in ROLES}
        atomic_write_text(path, json.dumps(creds, indent=2))  # mkstemp: mode 0600
    return creds


def bcrypt_hash(password: str) -> str:
    import bcrypt

    # nats-server recognises a bcrypt password by its "$2a$" prefix; the Python library writes "$2b$" by default
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=BCRYPT_ROUNDS, prefix=b"2a")).decode()


def telemetry_permissions(engine_ids: list[str]) -> dict[str, Any]:
    """Telemetry speaks for the HTTP members it scrapes, under any id, but not for our own engines (named)."""
    perms = json.loads(json.dumps(PERMISSIONS["telemetry"]))
    own = [s for e in engine_ids for s in (subjects.heartbeat(e), subjects.energy(e), f"$KV.{subjects.KV_WORKERS}.{e}")]
    perms["publish"]["deny"] = [*perms["publish"]["deny"], *own]
    return perms


def authorization_conf(creds: dict[str, str], engine_id: str | None = None) -> str:
    """The server config's ``authorization`` block: each role's user, bcrypt hash and permissions (JSON is a
    subset of the NATS config syntax, so the permission maps are written with json.dumps). With
    ``engine_id`` (``llmgw up`` names its engine), the ``engine`` user may use that engine's subjects only,
    and the ``telemetry`` user may not speak for it."""
    perms = dict(PERMISSIONS)
    if engine_id is not None:
        perms |= {"engine": engine_permissions(engine_id), "telemetry": telemetry_permissions([engine_id])}
    users = [
        f"    {{ user: {json.dumps(role)}, password: {json.dumps(bcrypt_hash(creds[role]))},\n"
        f"      permissions: {json.dumps(perms[role])} }}"
        for role in ROLES
    ]
    return "authorization {\n  users: [\n" + "\n".join(users) + "\n  ]\n}\n"


def url_with_credentials(url: str, user: str, password: str) -> str:
    """``nats://host:port`` (or a comma-separated list) with ``user:password@`` in each address, the form
    nats-py reads credentials from."""
    out = []
    for one in (u.strip() for u in url.split(",") if u.strip()):
        parts = urlsplit(one)
        host = parts.netloc.rpartition("@")[2]
        out.append(urlunsplit(parts._replace(netloc=f"{quote(user, safe='')}:{quote(password, safe='')}@{host}")))
    return ",".join(out)


def password_variable(role: str) -> str:
    """The environment variable a shipped NATS config reads ``role``'s password from (``engine.gpu-0`` →
    ``NATS_ENGINE_GPU_0_PASSWORD``)."""
    return "NATS_" + "".join(c if c.isalnum() else "_" for c in role.upper()) + "_PASSWORD"


def permissions_conf(engine_ids: list[str] | None = None) -> str:
    """``deploy/nats/permissions.conf``: the same users and permissions for an operator's own nats-server,
    each password read from :func:`password_variable` (the server refuses to start while one is unset; a
    ``$2a$`` bcrypt hash in the variable works too). ``engine_ids`` (``llmgw bus-permissions --engine ID``)
    adds one user per named engine, ``engine.<id>``, allowed that engine's subjects only; the shared
    ``engine`` user stays for engines not named (drop it once every engine has its own)."""
    named = [(engine_user(e), engine_permissions(e)) for e in engine_ids or []]
    entries = [(role, PERMISSIONS[role]) for role in ROLES] + named
    users = [
        f"    {{ user: {json.dumps(user)}, password: ${password_variable(user)},\n"
        f"      permissions: {json.dumps(perms)} }}"
        for user, perms in entries
    ]
    return ("# Generated from services/common/nats_auth.py (PERMISSIONS): one user per llmgw role with the subjects\n"
            "# it needs; tests/unit/test_nats_permissions.py keeps the two equal. Passwords come from the\n"
            "# environment: " + ", ".join(password_variable(u) for u, _ in entries) + ".\n"
            "# The shared `engine` user may use any engine's subjects; `llmgw bus-permissions --engine ID ...` writes\n"
            "# this file with one user per engine (engine.<ID>) held to that engine's own subjects.\n"
            "# Use it with `include permissions.conf` in place of another authorization block (docs/deploy.md).\n"
            "authorization {\n  users: [\n" + "\n".join(users) + "\n  ]\n}\n")


def main(argv: list[str] | None = None) -> None:
    """``llmgw bus-permissions [--engine ID ...] [-o FILE]``: print (or write, 0600) the permissions.conf for an
    operator's nats-server, with one user per named engine."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="llmgw bus-permissions", description=main.__doc__)
    parser.add_argument("--engine", action="append", default=[], metavar="ID",
                        help="an engine's --worker-id: it gets its own user, engine.<ID>, held to its own subjects")
    parser.add_argument("-o", "--output", type=Path, help="write here (mode 0600) instead of printing")
    args = parser.parse_args(argv)
    try:
        text = permissions_conf(args.engine)
    except ValueError as exc:
        parser.error(f"--engine: {exc}")
    if args.output is None:
        sys.stdout.write(text)
        return
    atomic_write_text(args.output, text)
    users = ", ".join(password_variable(engine_user(e)) for e in args.engine) or "none"
    print(f"wrote {args.output}; per-engine password variables: {users}", file=sys.stderr)
