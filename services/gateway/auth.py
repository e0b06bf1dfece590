"""Who is calling: API keys for inference, sessions for the browser pages, and the rules around them.

- Inference needs a valid ``Authorization: Bearer sk-…`` unless the caller's address lies in a network
  the operator trusts explicitly (``--trust-network CIDR``); loopback is *not* trusted by default.
- A key's daily token quota (prompt + output tokens, UTC day) is checked at admission: once spent, 429
  with ``Retry-After`` until UTC midnight. Open requests per key are capped (``max_concurrent_per_key``).
- Pages use the ``llmgw_session`` cookie (HttpOnly, SameSite=Lax, signed, 12 h, revocable); every
  state-changing form carries the session's CSRF token; sign-in failures back off per address + user.
- Admin JSON routes accept an admin session or an admin user's API key.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from services.common.http import HTTPError
from services.common.runtime import ConfigError
from services.gateway.identity import ApiKey, IdentityStore, Session, User, key_digest, seconds_to_utc_midnight, utc_day

log = logging.getLogger(__name__)

SESSION_COOKIE = "llmgw_session"
LOGIN_CSRF_COOKIE = "llmgw_login"
FREE_LOGIN_FAILURES = 3
MAX_LOGIN_DELAY_S = 300.0


class KeyUsageSummary(msgspec.Struct):
    """``llm.v1.quota.<gateway_id>``: the tokens each API key used through one gateway on one UTC day."""

    gateway_id: str
    day: str
    tokens: dict[str, int]


@dataclass
class LoginThrottle:
    """Exponential back-off per (address, user name) after a few wrong passwords. Pure: pass ``now_s``.

    Keyed by both so one attacker cannot lock a user out from everywhere, and one address cannot try
    many passwords for a user quickly. Bounded: the oldest entries go first past ``max_entries``.
    """

    max_entries: int = 10_000
    _failures: collections.OrderedDict[tuple[str, str], tuple[int, float]] = field(
        default_factory=collections.OrderedDict)

    def wait_s(self, ip: str, user: str, now_s: float) -> float:
        entry = self._failures.get((ip, user))
        return 0.0 if entry is None else max(0.0, entry[1] - now_s)

    def failed(self, ip: str, user: str, now_s: float) -> float:
        count = self._failures.pop((ip, user), (0, 0.0))[0] + 1
        delay = 0.0 if count < FREE_LOGIN_FAILURES else min(MAX_LOGIN_DELAY_S, 2.0 ** (count - FREE_LOGIN_FAILURES))
        self._failures[(ip, user)] = (count, now_s + delay)
        while len(self._failures) > self.max_entries:
            self._failures.popitem(last=False)
        return delay

    def succeeded(self, ip: str, user: str) -> None:
        self._failures.pop((ip, user), None)


def parse_networks(specs: Iterable[str]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    networks = []
    for spec in specs:
        try:
            networks.append(ipaddress.ip_network(spec.strip(), strict=False))
        except ValueError:
            raise ConfigError("trust-network", f"{spec!r} is not a network (use CIDR, e.g. 10.0.0.0/8)") from None
    return tuple(networks)


class Auth:
    """The gateway's identity rules over an :class:`IdentityStore` (see the module doc)."""

    def __init__(self, store: IdentityStore, trusted: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = (),
                 max_concurrent_per_key: int = 64, gateway_id: str = "") -> None:
        self.store = store
        self.gateway_id = gateway_id
        self.trusted = trusted
        self.max_concurrent_per_key = max_concurrent_per_key
        self.throttle = LoginThrottle()
        self._day = ""
        self._day_index = -1
        self._used: dict[str, int] = {}
        self._dirty = False
        self._open: collections.Counter[str] = collections.Counter()
        self._elsewhere: dict[str, dict[str, int]] = {}  # other gateway → its tokens per key today
        self._elsewhere_total: collections.Counter[str] = collections.Counter()

    # ---- inference --------------------------------------------------------------------------------

    def is_trusted(self, request: web.Request) -> bool:
        if not self.trusted or request.remote is None:
            return False
        try:
            address = ipaddress.ip_address(request.remote)
        except ValueError:
            return False
        return any(address in net for net in self.trusted)

    def bearer_key(self, request: web.Request, now_s: float) -> ApiKey | None:
        """The request's valid API key; None when it sent none. A bad one is a 401 here."""
        header = request.headers.get("Authorization", "")
        if not header:
            return None
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise HTTPError(401, "send your API key as 'Authorization: Bearer sk-…'", code="invalid_api_key")
        key = self.store.lookup_key(key_digest(token), now_s)
        if key is None:
            raise HTTPError(401, "invalid, revoked or expired API key; create one on your account page",
                            code="invalid_api_key")
        return key

    def admit(self, request: web.Request, now_s: float) -> ApiKey | None:
        """Check the caller may run inference now; returns its key (None for a trusted network)."""
        key = self.bearer_key(request, now_s)
        if key is None:
            if self.is_trusted(request):
                return None
            raise HTTPError(401, "an API key is required: send 'Authorization: Bearer sk-…' "
                                 "(create one on your account page)", code="missing_api_key")
        return self.admit_key(key, now_s)

    def admit_key(self, key: ApiKey, now_s: float) -> ApiKey:
        """Quota and open-request checks for a valid key; counts the request as open."""
        self._roll_day(now_s)
        if key.daily_quota is not None and self.used_today(key.key_id, now_s) >= key.daily_quota:
            raise HTTPError(429, f"daily token quota of {key.daily_quota} spent for key {key.key_id}; it renews at "
                                 "00:00 UTC", code="quota_exceeded", retry_after_s=seconds_to_utc_midnight(now_s))
        if self._open[key.key_id] >= self.max_concurrent_per_key:
            raise HTTPError(429, f"too many open requests for key {key.key_id} (limit "
                                 f"{self.max_concurrent_per_key}); retry when one finishes",
                            code="too_many_concurrent_requests", retry_after_s=1)
        self._open[key.key_id] += 1
        return key

    def finished(self, key: ApiKey | None, tokens: int, now_s: float) -> None:
        """A request admitted with ``key`` ended having used ``tokens`` (prompt + output)."""
        if key is None:
            return
        self._open[key.key_id] -= 1
        if self._open[key.key_id] <= 0:
            del self._open[key.key_id]
        if tokens > 0:
            self._roll_day(now_s)
            self._used[key.key_id] = self._used.get(key.key_id, 0) + tokens
            self._dirty = True

    def usage_summary(self, now_s: float) -> KeyUsageSummary:
        """What each key used through this gateway today (for the other gateways' quota checks)."""
        self._roll_day(now_s)
        return KeyUsageSummary(self.gateway_id, self._day, dict(self._used))

    def used_elsewhere(self, summary: KeyUsageSummary, now_s: float) -> None:
        """Another gateway's summary: its tokens count against each key's quota here too."""
        self._roll_day(now_s)
        if summary.day == self._day:
            self._elsewhere[summary.gateway_id] = summary.tokens
        else:
            self._elsewhere.pop(summary.gateway_id, None)
        total: collections.Counter[str] = collections.Counter()
        for counts in self._elsewhere.values():
            total.update(counts)
        self._elsewhere_total = total

    def used_today(self, key_id: str, now_s: float) -> int:
        """Tokens the key used today, through this gateway and (as they last said) the others."""
        self._roll_day(now_s)
        return self._used.get(key_id, 0) + self._elsewhere_total.get(key_id, 0)

    def _roll_day(self, now_s: float) -> None:
        day_index = int(now_s // 86400)  # UTC days are 86,400 epoch seconds each: no calendar work per request
        if day_index == self._day_index:
            return
        self._day_index = day_index
        day = utc_day(now_s)
        if day != self._day:
            if self._dirty:
                self.store.save_usage(self._day, self._used)
            self._day, self._used, self._dirty = day, self.store.load_usage(day), False
            self._elsewhere, self._elsewhere_total = {}, collections.Counter()

    def save_usage(self) -> None:
        if self._dirty:
            self.store.save_usage(self._day, dict(self._used))
            self._dirty = False

    # ---- pages ------------------------------------------------------------------------------------

    def session(self, request: web.Request, now_s: float) -> Session | None:
        return self.store.session(request.cookies.get(SESSION_COOKIE), now_s)

    def page_user(self, request: web.Request, now_s: float, admin: bool) -> Session:
        """The signed-in user for a page; no session → redirect to sign-in; a user on an admin page → 403."""
        session = self.session(request, now_s)
        if session is None:
            raise web.HTTPSeeOther(f"/?next={request.path_qs}" if request.method == "GET" else "/")
        if admin and session.user.role != "admin":
            raise HTTPError(403, "this page is for administrators", code="admin_required")
        return session

    def api_user(self, request: web.Request, now_s: float, admin: bool) -> User:
        """The caller of an admin JSON route: a session, or an API key of a user (401 / 403 otherwise)."""
        session = self.session(request, now_s)
        user = session.user if session is not None else None
        if user is None:
            key = self.bearer_key(request, now_s)
            user = self.store.user(key.user_id) if key is not None else None
        if user is None:
            raise HTTPError(401, "sign in (session cookie) or send an admin API key as 'Authorization: Bearer sk-…'",
                            code="unauthenticated")
        if admin and user.role != "admin":
            raise HTTPError(403, "administrators only", code="admin_required")
        return user

    @staticmethod
    def check_csrf(session: Session, form_token: object) -> None:
        if not isinstance(form_token, str) or not hmac.compare_digest(form_token.encode(), session.csrf.encode()):
            raise HTTPError(403, "the form's CSRF token is missing or wrong: reload the page and try again",
                            code="csrf_failed")


async def save_usage_periodically(auth: Auth, every_s: float = 5.0) -> None:
    """Persist quota counters now and then (and the caller saves once more at shutdown)."""
    while True:
        await asyncio.sleep(every_s)
        try:
            auth.save_usage()
        except Exception as exc:  # a full disk must not stop serving; the counters stay in memory
            log.warning("key usage not saved: %s", exc)
