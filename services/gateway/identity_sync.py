"""Users and API keys shared by every gateway on the bus, so a key made on one works on all of them.

Each gateway keeps its own SQLite copy (:mod:`services.gateway.identity`) and answers from it, so a
request never waits on the bus. Changes travel through the JetStream bucket ``llm_identity`` (one entry
per row, ``users.<user_id>`` / ``api_keys.<key_id>`` / ``limits.<principal>``, a JSON
:class:`proto.UserRow` / :class:`proto.ApiKeyRow` / :class:`proto.LimitsRow`, the newest version kept):

- a change made here is put into the bucket, retried until the bus takes it;
- a gateway starting up applies the whole bucket before it decides whether it is the first one (only
  one gateway creates the bootstrap admin, elected by ``kv.create``), then offers its own rows that the
  bucket lacks or holds older (users made with ``llmgw admin create-user`` while it was stopped);
- puts from the others arrive on a plain subscription to the bucket's subjects, which the client
  re-establishes after a reconnect; a full pass every :data:`RESYNC_S` catches what an outage hid and
  what ``llmgw admin`` wrote into this gateway's file behind its back.

Every row put here is signed with the fleet secret, and a row without a valid signature is ignored
(:mod:`services.gateway.identity_signing`; logged once per cause), so only this fleet's gateways can
add a user or a key, whoever else reaches the bucket.

Per row, the version with the later ``updated_s`` wins. Sessions are not shared: a browser signs in
to each gateway it talks to (use sticky sessions for the admin pages behind a load balancer).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import time
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from proto import IDENTITY_ROWS, ProtoDecodeError, decode_json, encode_json, subjects
from services.common.runtime import raise_if_cancelling
from services.gateway import identity_signing
from services.gateway.identity import REPLICATED, IdentityStore

log = logging.getLogger(__name__)

RESYNC_S = 15.0
RETRY_S = 1.0
BOOTSTRAP_KEY = "bootstrap"
_KV_PREFIX = f"$KV.{subjects.KV_IDENTITY}."
_STREAM = f"KV_{subjects.KV_IDENTITY}"  # the stream behind the bucket


def entry_key(table: str, row: dict[str, Any]) -> str:
    return f"{table}.{row[REPLICATED[table][0]]}"


class IdentitySync:
    """Keeps an :class:`IdentityStore` in step with the bus bucket (see the module doc)."""

    def __init__(self, nc: Client, store: IdentityStore, gateway_id: str, secret: bytes) -> None:
        self.nc = nc
        self.secret = secret  # the fleet secret the rows are signed with
        self.refused = 0  # rows ignored for a missing or bad signature
        self._refusal_logged: set[str] = set()
        self.store = store
        self.gateway_id = gateway_id
        self.kv: KeyValue | None = None
        self._outbox: dict[str, bytes] = {}  # bucket key → newest version not yet taken by the bus
        self._wake = asyncio.Event()
        self._waiting: dict[str, tuple[str, dict[str, Any]]] = {}  # rows whose user has not arrived yet
        self.applied = 0
        self._sub: Any = None
        store.on_change = self._local_change

    # ---- start ------------------------------------------------------------------------------------

    async def start(self) -> bool:
        """Bind (or create) the bucket and apply what it holds. False: no bucket, this gateway stands alone."""
        js = self.nc.jetstream()
        try:
            try:
                self.kv = await js.key_value(subjects.KV_IDENTITY)
            except (BucketNotFoundError, NotFoundError):
                self.kv = await js.create_key_value(KeyValueConfig(
                    bucket=subjects.KV_IDENTITY, history=1, storage=StorageType.FILE,
                    description="users and API keys shared by the gateways"))
            # listen first, then read the bucket: a put in between arrives by one path or both (newest wins)
            self._sub = await self.nc.subscribe(_KV_PREFIX + ">", cb=self._on_put)
            await self.nc.flush()
            await self._pull_all()
        except Exception as exc:
            raise_if_cancelling()
            log.warning("users and keys are not shared with other gateways (bus bucket unavailable: %s)", exc)
            if self._sub is not None:
                with contextlib.suppress(Exception):
                    await self._sub.unsubscribe()
            self.kv = self._sub = None
            return False
        return True

    async def claim_bootstrap(self) -> bool:
        """True for exactly one gateway of a fleet with no users: it creates the first admin.

        The claim is a signed row like the others: a ``bootstrap`` key that no gateway of this fleet wrote (put
        there by another bus client to keep the fleet from ever getting an admin) is replaced, not obeyed."""
        if self.kv is None:
            return True
        claim = identity_signing.sign(self.secret, BOOTSTRAP_KEY, json.dumps(
            {"gateway_id": self.gateway_id, "claimed_s": time.time()}).encode())
        try:
            await self.kv.create(BOOTSTRAP_KEY, claim)
            return True
        except KeyWrongLastSequenceError:
            pass
        try:
            held = await self.kv.get(BOOTSTRAP_KEY)
        except Exception:
            return False  # deleted in between, or unreadable: let the gateway that took it go on
        why = identity_signing.check(self.secret, BOOTSTRAP_KEY, held.value or b"")
        if why is None:
            return False
        log.warning("the %s key in %s is not signed by this fleet (%s signature): replacing it and creating the "
                    "first admin here", BOOTSTRAP_KEY, subjects.KV_IDENTITY, why)
        try:
            await self.kv.update(BOOTSTRAP_KEY, claim, last=held.revision)
            return True
        except KeyWrongLastSequenceError:
            return False  # another gateway replaced it first

    async def _pull_all(self) -> None:
        """Apply every row in the bucket, then offer ours that it lacks or holds older.

        Read message by message (``next_by_subj`` from the last sequence seen) rather than with a KV
        watcher: the end is a plain "no message", not a marker that may never come.
        """
        assert self.kv is not None
        js = self.nc.jetstream()
        held: dict[str, float] = {}
        seq = 1
        while True:
            try:
                msg = await js.get_msg(_STREAM, seq=seq, subject=_KV_PREFIX + ">", next=True)
            except NotFoundError:
                break
            raise_if_cancelling()  # see raise_if_cancelling: a cancel that lands as an answer arrives is lost
            assert msg.seq is not None  # nats-py types it optional; a stored message has its sequence
            seq = msg.seq + 1
            key = (msg.subject or "").removeprefix(_KV_PREFIX)
            if key == BOOTSTRAP_KEY or not msg.data or (msg.headers or {}).get("KV-Operation"):
                continue
            row = self._apply(key, msg.data)
            if row is not None:
                held[key] = float(row.get("updated_s") or 0.0)
        self._retry_waiting()
        self.store.refresh()  # rows ``llmgw admin`` changed in the file while we ran
        for table, row in self.store.replica_rows():
            key = entry_key(table, row)
            if float(row["updated_s"]) > held.get(key, -1.0):  # type: ignore[arg-type]  # a row's values are objects; updated_s is REAL NOT NULL
                self._local_change(table, row)

    # ---- running ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Send our changes, take the others' (until cancelled)."""
        if self.kv is None:
            return
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._send_outbox(), name="identity-send")
                tasks.create_task(self._resync(), name="identity-resync")
        finally:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    def _local_change(self, table: str, row: dict[str, Any]) -> None:
        key = entry_key(table, row)
        self._outbox[key] = identity_signing.sign(self.secret, key, encode_json(IDENTITY_ROWS[table](**row)))
        self._wake.set()

    async def _send_outbox(self) -> None:
        assert self.kv is not None
        while True:
            raise_if_cancelling()
            await self._wake.wait()
            self._wake.clear()
            while self._outbox:
                key, value = next(iter(self._outbox.items()))
                try:
                    await self.kv.put(key, value)
                except Exception as exc:
                    raise_if_cancelling()
                    log.warning("a user/key change waits for the bus (%s); retrying", exc)
                    await asyncio.sleep(RETRY_S)
                    continue
                if self._outbox.get(key) is value:  # not changed again meanwhile
                    del self._outbox[key]

    async def _resync(self) -> None:
        while True:
            raise_if_cancelling()
            await asyncio.sleep(RESYNC_S)
            try:
                await self._pull_all()
            except Exception as exc:
                raise_if_cancelling()
                log.debug("identity resync skipped: %s", exc)

    async def _on_put(self, msg: Msg) -> None:
        key = msg.subject.removeprefix(_KV_PREFIX)
        if key != BOOTSTRAP_KEY and msg.data:
            if self._apply(key, msg.data) is not None and key.startswith("users."):
                self._retry_waiting()

    # ---- applying ---------------------------------------------------------------------------------

    def _apply(self, key: str, value: bytes) -> dict[str, Any] | None:
        """Apply one bucket entry; the decoded row, or None when it was refused."""
        table = key.partition(".")[0]
        problem = identity_signing.check(self.secret, key, value)
        if problem is not None:
            self.refused += 1
            if problem not in self._refusal_logged:  # once per cause: a flood of forged rows is not a flood of logs
                self._refusal_logged.add(problem)
                log.warning("ignored shared identity entry %s: its signature is %s (not written by a gateway "
                            "with this fleet's secret; set the same LLMGW_FLEET_SECRET on every gateway); "
                            "further entries refused for this cause are counted, not logged", key, problem)
            return None
        try:
            row_type = IDENTITY_ROWS.get(table)
            if row_type is None:
                raise ValueError(f"no table {table!r} is shared")
            row = msgspec.structs.asdict(decode_json(value, row_type))
            if self.store.apply_replica(table, row):
                self.applied += 1
        except sqlite3.IntegrityError as exc:
            if table == "api_keys" and "FOREIGN KEY" in str(exc):
                self._waiting[key] = (table, row)  # its user comes later in the bucket's order
                return row
            log.warning("kept our own version of %s: the shared one conflicts here (%s)", key, exc)
            return None
        except (ProtoDecodeError, ValueError, TypeError, KeyError) as exc:
            log.warning("ignored a malformed shared identity entry %s: %s", key, exc)
            return None
        self._waiting.pop(key, None)
        return row

    def _retry_waiting(self) -> None:
        for key, (table, row) in list(self._waiting.items()):
            with contextlib.suppress(sqlite3.IntegrityError, ValueError):
                self.store.apply_replica(table, row)
                self._waiting.pop(key, None)
                self.applied += 1
