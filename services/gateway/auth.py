"""Who is calling: API keys for inference, sessions for the browser pages, and the rules around them.

- Inference needs a valid ``Authorization: Bearer sk-…`` unless the caller's address lies in a network
  the operator trusts explicitly (``--trust-network CIDR``); loopback is *not* trusted by default.
- Limits bind the principal (services/gateway/limits.py): the key's user, and the key's lineage (the
  key and the keys rotated from it). Admission reserves, completion settles; a limit with no room left is
  a 429 with ``Retry-After`` and a ``code`` naming the limit. Open requests per key are capped
  (``max_concurrent_per_key``).
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

from aiohttp import web

from services.common.http import HTTPError
from services.common.runtime import ConfigError
from services.gateway.identity import ApiKey, IdentityStore, Session, User, key_digest
from services.gateway.limits import Cost, LimitBook, Principal, Reservation, counter_key, key_principal, window

log = logging.getLogger(__name__)

SESSION_COOKIE = "llmgw_session"
LOGIN_CSRF_COOKIE = "llmgw_login"
FREE_LOGIN_FAILURES = 3
MAX_LOGIN_DELAY_S = 300.0


class LimitExceeded(HTTPError):
    """A 429 from a limit (or the open-requests cap); ``kind`` goes into the request's usage row."""

    def __init__(self, kind: str, message: str, code: str, retry_after_s: float) -> None:
        super().__init__(429, message, code=code, type="rate_limit_error", retry_after_s=retry_after_s)
        self.kind = kind


@dataclass(frozen=True)
class Admission:
    """An admitted request: its key, the principals whose limits it counts against, its reservation."""

    key: ApiKey
    principals: tuple[Principal, ...]
    reservation: Reservation


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

    def begin(self, ip: str, user: str, now_s: float) -> float:
        """Reserve one attempt *before* the (slow) password check: it counts as a wrong password until
        :meth:`succeeded` says otherwise. Returns the wait (> 0: refused now). Checked-then-recorded let 40
        parallel guesses all reach the hash, the right one among them included (issue #25); reserved first,
        at most ``FREE_LOGIN_FAILURES`` can be in flight before the back-off applies to the rest."""
        wait = self.wait_s(ip, user, now_s)
        if wait <= 0:
            self.failed(ip, user, now_s)
        return wait

    def succeeded(self, ip: str, user: str) -> None:
        self._failures.pop((ip, user), None)


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(specs: Iterable[str]) -> tuple[Network, ...]:
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
                 max_concurrent_per_key: int = 64, gateway_id: str = "", usage_owner: str = "") -> None:
        self.store = store
        # whose rows of the shared identity.db's limit_usage this process keeps: its worker label, "" alone
        self.usage_owner = usage_owner
        self.gateway_id = gateway_id
        self.trusted = trusted
        # the pools file's local_networks while gateway.trust_local_networks is on (the Go gateway's LAN trust);
        # as there, a loopback peer is never trusted by them (a tunnel or proxy on the host arrives as loopback)
        self.file_trusted: tuple[Network, ...] = ()
        self.max_concurrent_per_key = max_concurrent_per_key
        self.throttle = LoginThrottle()
        self.book = LimitBook()
        self.book.restore(store.load_limit_usage(usage_owner))
        self._dirty = False
        self._open: collections.Counter[str] = collections.Counter()

    # ---- inference --------------------------------------------------------------------------------

    def is_trusted(self, request: web.Request) -> bool:
        if not (self.trusted or self.file_trusted) or request.remote is None:
            return False
        try:
            address = ipaddress.ip_address(request.remote)
        except ValueError:
            return False
        if any(address in net for net in self.trusted):
            return True
        return not address.is_loopback and any(address in net for net in self.file_trusted)

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
        """Who is calling: its valid key, None for a trusted network; 401 otherwise. Limits are checked
        by :meth:`admit_key` once the request's size is known."""
        key = self.bearer_key(request, now_s)
        if key is None:
            if self.is_trusted(request):
                return None
            raise HTTPError(401, "an API key is required: send 'Authorization: Bearer sk-…' "
                                 "(create one on your account page)", code="missing_api_key")
        return key

    def admit_key(self, key: ApiKey, now_s: float, cost: Cost | None = None) -> Admission:
        """The open-requests cap and every limit of the key's principals; reserves ``cost`` (default: one
        request, no tokens) and counts the request as open. Raises :class:`LimitExceeded`."""
        if self._open[key.key_id] >= self.max_concurrent_per_key:
            raise LimitExceeded("concurrent_requests", f"too many open requests for key {key.key_id} (limit "
                                f"{self.max_concurrent_per_key}); retry when one finishes",
                                "too_many_concurrent_requests", 1.0)
        principals = self.store.principals_of(key)
        refusal = self.book.check(principals, now_s)
        if refusal is not None:
            raise LimitExceeded(refusal.kind, refusal.message(), refusal.code, refusal.retry_after_s)
        reservation = self.book.reserve(principals, cost or Cost(), now_s)
        self._open[key.key_id] += 1
        return Admission(key, principals, reservation)

    def rate_headers(self, admission: Admission | None, now_s: float) -> dict[str, str]:
        return {} if admission is None else self.book.rate_headers(admission.principals, now_s)

    def finished(self, admission: Admission | None, tokens: int, now_s: float, usd: float = 0.0) -> None:
        """A request admitted as ``admission`` ended having used ``tokens`` (prompt + output) worth ``usd``."""
        if admission is None:
            return
        key_id = admission.key.key_id
        self._open[key_id] -= 1
        if self._open[key_id] <= 0:
            del self._open[key_id]
        self.book.settle(admission.reservation, Cost(tokens=max(0, tokens), requests=1, usd=max(0.0, usd)))
        self._dirty = True

    def limit_counters(self, now_s: float) -> dict[str, float]:
        """What this gateway counted in the current windows (for the other gateways' checks)."""
        return self.book.own_counters(now_s)

    def counted_elsewhere(self, gateway_id: str, counters: dict[str, float]) -> None:
        """Another gateway's newest counters: they count against the limits here too."""
        if gateway_id != self.gateway_id:
            self.book.merge_remote(gateway_id, counters)

    def used_today(self, key_id: str, now_s: float) -> int:
        """Tokens the key's lineage used today, here and (as they last said) at the other gateways."""
        key = self.store.key_by_id(key_id)
        lineage = key.lineage if key is not None and key.lineage else key_id
        return int(self.book.counted(counter_key(key_principal(lineage), "tokens_per_day",
                                                 window("tokens_per_day", now_s))))

    def save_usage(self) -> None:
        if self._dirty:
            self.store.save_limit_usage(self.book.persistent(), self.usage_owner)
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
