"""The gateway's answers to its peers on the bus: auth checks for other services, the limit counters
shared with the other gateways, the ledger's month-to-date energy per key, and the first start's admin.

Every gateway answers every auth check; one that does not know the key answers
:data:`NEGATIVE_AUTH_DELAY_S` later, so the asker (which takes the first reply) hears the one that does.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import time

from nats.aio.client import Client
from nats.aio.msg import Msg

from proto import (
    AuthCheck,
    AuthReply,
    KeyEnergyQuery,
    KeyEnergyReply,
    LimitCounters,
    ProtoDecodeError,
    decode,
    decode_json,
    encode,
    encode_json,
    subjects,
)
from services.common.runtime import ConfigError, ThrottledLog, raise_if_cancelling
from services.gateway.auth import Auth
from services.gateway.identity import IdentityError, IdentityStore
from services.gateway.limits import month_of as limits_month

# A gateway that does not know a key answers an auth check this much later than one that does.
NEGATIVE_AUTH_DELAY_S = 0.25
# How often each gateway tells the others its per-key token counts (a quota may overrun by this much traffic).
QUOTA_SHARE_S = 1.0


ADMIN_PASSWORD_ENV = "LLMGW_ADMIN_PASSWORD"


def bootstrap_admin(identity: IdentityStore) -> tuple[str, str]:
    """First start: an admin user with ``$LLMGW_ADMIN_PASSWORD`` or a generated password, and one API key,
    printed once (never logged; the operator's own password is not printed at all)."""
    given = os.environ.get(ADMIN_PASSWORD_ENV) or None
    try:
        password, key = identity.bootstrap_admin(time.time(), given)
    except IdentityError as exc:
        raise ConfigError(ADMIN_PASSWORD_ENV, exc.message) from None
    shown = f"the password in ${ADMIN_PASSWORD_ENV}" if given else f"password {password}"
    print(f"llmgw gateway: first start: created user 'admin' ({shown}) and API key {key}; "
          "both are shown only this once: sign in at the gateway's / to manage keys and users", flush=True)
    return password, key


class Peers:
    """The bus responders and sharers that keep keys and limits consistent across gateways."""

    def __init__(self, nc: Client, identity: IdentityStore, auth: Auth, gateway_id: str, session_id: str,
                 key_energy_poll_s: float, quiet_log: ThrottledLog) -> None:
        self.nc = nc
        self.identity = identity
        self.auth = auth
        self.gateway_id = gateway_id
        self.session_id = session_id
        self.key_energy_poll_s = key_energy_poll_s
        self._quiet_log = quiet_log

    async def _on_auth_check(self, msg: Msg) -> None:
        """Other services (accounting's /sql, /costs) ask whether an API key's digest is valid, and whose."""
        try:
            digest: str | None = decode_json(msg.data, AuthCheck).key_sha256
        except ProtoDecodeError:
            digest = None
        key = self.identity.lookup_key(digest, time.time()) if digest is not None else None
        user = self.identity.user(key.user_id) if key is not None else None
        reply = AuthReply(ok=False)
        if key is not None and user is not None:
            reply = AuthReply(ok=True, role=user.role, key_id=key.key_id, user=user.name)
        else:  # every gateway answers and the asker takes the first reply: let one that knows the key win
            await asyncio.sleep(NEGATIVE_AUTH_DELAY_S)
        with contextlib.suppress(Exception):
            await msg.respond(encode_json(reply))

    async def _share_limit_counters(self) -> None:
        """Tell the other gateways what this one counted against every limit, so limits hold fleet-wide."""
        told: dict[str, float] | None = None
        seq = 0
        while True:
            raise_if_cancelling()
            await asyncio.sleep(QUOTA_SHARE_S)
            now = time.time()
            counters = self.auth.limit_counters(now)
            if counters == told:
                continue
            seq += 1
            message = LimitCounters(gateway_id=self.gateway_id, session_id=self.session_id, seq=seq,
                                    ts_s=now, counters=counters)
            with contextlib.suppress(Exception):  # the bus is down: the next round tells them
                await self.nc.publish(subjects.quota(self.gateway_id), encode(message))
                told = counters

    async def _poll_key_energy(self) -> None:
        """The ledger's month-to-date energy per key, summed per principal, for the kWh-per-month limits.

        Asked only while some principal has such a limit. The ledger's figure lags the engines (samples
        every few seconds, attribution when both the sample and the usage record are in); a limit can be
        overshot by what ran in that lag (docs/admin.md, "Limits")."""
        while True:
            raise_if_cancelling()
            await asyncio.sleep(self.key_energy_poll_s)
            if not any(lim.kwh_per_month is not None for lim in self.identity.all_limits().values()):
                continue
            now = time.time()
            month = limits_month(now)
            try:
                msg = await self.nc.request(subjects.ACCOUNTING_KEY_ENERGY, encode(KeyEnergyQuery(month=month)),
                                            timeout=5.0)
                reply = decode(msg.data, KeyEnergyReply)
            except Exception as exc:  # accounting down or slow: keep the last figure (the page says its age)
                raise_if_cancelling()
                self._quiet_log.warning("key-energy", "month-to-date key energy not read from accounting: %s", exc)
                continue
            if reply.month != month:
                continue
            kwh: collections.defaultdict[str, float] = collections.defaultdict(float)
            keys = {k.key_id: k for k in self.identity.keys_of(None)}
            for key_id, joules in reply.joules_by_key.items():
                key = keys.get(key_id)
                if key is None:
                    continue
                for principal in self.identity.principals_of(key):
                    kwh[principal.principal_id] += joules / 3.6e6
            self.auth.book.set_energy(month, dict(kwh), reply.as_of_s)

    async def _on_limit_counters_elsewhere(self, msg: Msg) -> None:
        try:
            message = decode(msg.data, LimitCounters)
        except ProtoDecodeError:
            return  # e.g. an older gateway's JSON summary: it cannot be merged with these counters
        self.auth.counted_elsewhere(message.gateway_id, message.counters)
