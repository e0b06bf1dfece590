"""The admin pages, rendered on the server (jinja2, autoescaped; no build step): sign-in, Backends, Config,
Usage & costs, Users (with each key's daily quota), Limits (every user's and key's limits and spend, also as
``/admin/limits.json``) and each user's own keys page. Handlers only; the rules live in auth.py and limits.py,
the form ↔ config mapping in config_form.py, the form ↔ limits mapping in limits_form.py and the charts in
charts.py (all pure).
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import msgspec
from aiohttp import web
from markupsafe import Markup
from nats.aio.client import Client
from yarl import URL

from proto import CostsQuery, CostsReport, ErrorReply, ProtoDecodeError, decode_json, encode_json, subjects
from services.common.http import HTTPError, read_form, read_json_object
from services.gateway import charts, config_form, limits_form
from services.gateway.auth import LOGIN_CSRF_COOKIE, SESSION_COOKIE, Auth
from services.gateway.identity import (
    ApiKey,
    IdentityError,
    Limits,
    Session,
    User,
    check_password_rules,
    check_user_name,
    hash_password,
    new_password,
    parse_daily_quota,
    verify_password,
)
from services.gateway.limits import KINDS, key_principal, user_principal
from services.gateway.pools_file import PoolsFile

_HERE = Path(__file__).parent
STYLE = (_HERE / "static" / "style.css").read_bytes()
GRACE_HOURS_DEFAULT = 24.0
COSTS_TIMEOUT_S = 5.0  # the admin costs page waits this long for the accounting service
OWN_USAGE_TIMEOUT_S = 2.0  # a user's own page shows its keys without the 30-day figures after this


def _num(value: Any, digits: int = 0, suffix: str = "") -> str:
    if value is None:
        return "\u2013"  # en dash: "unknown"
    return f"{value:,.{digits}f}{suffix}"


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(_HERE / "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined)
    env.filters["num"] = _num
    env.filters["sparkline"] = lambda history: Markup(charts.sparkline_svg(history))
    return env


def _wants_html(request: web.Request) -> bool:
    accept = request.headers.get("Accept", "")
    return "text/html" in accept and "application/json" not in accept.split(",")[0]


def _safe_next(value: object, fallback: str) -> str:
    """Only same-site paths: never an open redirect to another host.

    Judged on the URL as it will be sent, not only the raw text: yarl (which builds ``Location``) drops tabs
    and newlines, so ``/\t/evil.example`` passed a raw-text check and left as ``//evil.example`` (issue #25).
    Control characters and whitespace are refused outright, then the normalised URL must be a path on this
    host (no scheme, no authority, not ``//``)."""
    if not isinstance(value, str) or not value.startswith("/") or "\\" in value:
        return fallback
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in value):
        return fallback
    try:
        url = URL(value)
    except ValueError:
        return fallback
    text = str(url)
    if url.scheme or url.raw_authority or not text.startswith("/") or text.startswith("//") or "\\" in text:
        return fallback
    return text


class Pages:
    """The admin pages' handlers. ``backends_view`` gives the /backends rows; ``nc`` asks accounting for the
    costs; the Config page reads and saves ``pools_file``."""

    def __init__(self, auth: Auth, nc: Client, pools_file: PoolsFile, backends_view: Callable[[], list[dict[str, Any]]],
                 gateway_id: str, key_energy_poll_s: float) -> None:
        self.auth = auth
        self.nc = nc
        self.pools_file = pools_file
        self.backends_view = backends_view
        self.gateway_id = gateway_id
        self.key_energy_poll_s = key_energy_poll_s
        self.env = _env()
        self._dummy_password_hash: str | None = None  # verified against for unknown user names (timing)

    def routes(self, app: web.Application) -> None:
        r = app.router
        r.add_get("/", self.signin_page)
        r.add_post("/login", self.login)
        r.add_post("/logout", self.logout)
        r.add_get("/static/style.css", self.stylesheet)
        r.add_get("/backends", self.backends)
        r.add_get("/admin/config/page", self.config_page)
        r.add_post("/admin/config/page", self.config_save)
        r.add_get("/admin/costs", self.costs_page)
        r.add_get("/admin/costs.json", self.costs_json)
        r.add_get("/admin/users", self.users_page)
        r.add_post("/admin/users", self.users_create)
        r.add_post("/admin/keys/{key_id}/quota", self.key_quota)
        r.add_post("/admin/keys/{key_id}/revoke", self.admin_key_revoke)
        r.add_post("/admin/users/{user_id}/role", self.user_role)
        r.add_post("/admin/users/{user_id}/disable", self.user_disable)
        r.add_post("/admin/users/{user_id}/enable", self.user_enable)
        r.add_post("/admin/users/{user_id}/delete", self.user_delete)
        r.add_get("/admin/limits", self.limits_page)
        r.add_post("/admin/limits/user/{user_id}", self.limits_user_save)
        r.add_post("/admin/limits/key/{key_id}", self.limits_key_save)
        r.add_get("/admin/limits.json", self.limits_json)
        r.add_put("/admin/limits.json", self.limits_json_put)
        r.add_get("/account", self.account_page)
        r.add_post("/account/keys", self.key_create)
        r.add_post("/account/keys/{key_id}/rotate", self.key_rotate)
        r.add_post("/account/keys/{key_id}/revoke", self.key_revoke)

    def render(self, template: str, status: int = 200, **context: Any) -> web.Response:
        context.setdefault("session", None)
        html = self.env.get_template(template).render(**context)
        return web.Response(text=html, status=status, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store", "X-Frame-Options": "DENY",
                                     "Content-Security-Policy": "default-src 'self'; script-src 'self' 'unsafe-inline';"
                                                                " style-src 'self'; img-src 'self' data:"})

    async def stylesheet(self, request: web.Request) -> web.Response:
        return web.Response(body=STYLE, content_type="text/css", headers={"Cache-Control": "max-age=3600"})

    async def _form(self, request: web.Request, session: Session) -> dict[str, str]:
        form = await read_form(request)
        self.auth.check_csrf(session, form.get("csrf"))
        return form

    # ---- sign-in ----------------------------------------------------------------------------------

    def _signin(self, request: web.Request, status: int = 200, error: str = "", name: str = "",
                next_path: str = "") -> web.Response:
        nonce = secrets.token_urlsafe(16)
        resp = self.render("signin.html", status, title="Sign in", page="signin", error=error, name=name,
                           next=next_path, csrf=self.auth.store.sign_value(nonce))
        resp.set_cookie(LOGIN_CSRF_COOKIE, nonce, httponly=True, samesite="Lax", max_age=3600,
                        secure=request.secure)
        return resp

    async def signin_page(self, request: web.Request) -> web.Response:
        session = self.auth.session(request, time.time())
        if session is not None:
            home = "/backends" if session.user.role == "admin" else "/account"
            raise web.HTTPSeeOther(_safe_next(request.query.get("next"), home))
        return self._signin(request, next_path=_safe_next(request.query.get("next"), ""))

    async def login(self, request: web.Request) -> web.Response:
        form = await read_form(request)
        nonce = request.cookies.get(LOGIN_CSRF_COOKIE, "")
        token = form.get("csrf")
        expected = self.auth.store.sign_value(nonce).encode()
        if not nonce or not isinstance(token, str) or not hmac.compare_digest(token.encode(), expected):
            raise HTTPError(403, "the sign-in form expired or came from elsewhere: reload the page", code="csrf_failed")
        name, password = str(form.get("name", "")), str(form.get("password", ""))
        next_path = _safe_next(form.get("next"), "")
        ip = request.remote or "-"
        now = time.time()
        wait = self.auth.throttle.begin(ip, name, now)  # counted as a failure until the password checks out
        if wait > 0:
            resp = self._signin(request, 429, f"Too many wrong passwords: try again in {wait:.0f} s.", name, next_path)
            resp.headers["Retry-After"] = str(int(wait) + 1)
            return resp
        found = self.auth.store.password_hash(name)
        # Verify even for an unknown user (against a dummy hash), so timing does not reveal who exists.
        stored = found[1] if found else await self._dummy_hash()
        ok = await asyncio.to_thread(verify_password, password, stored) and found is not None
        if not ok:
            return self._signin(request, 401, "Wrong user name or password.", name, next_path)
        self.auth.throttle.succeeded(ip, name)
        assert found is not None
        user = found[0]
        if user.disabled:
            return self._signin(request, 403, "This account is disabled: ask an administrator.", name, next_path)
        old = request.cookies.get(SESSION_COOKIE)
        self.auth.store.end_session(old)  # a new session id at every login: no fixation
        cookie, _ = self.auth.store.create_session(user, time.time())
        home = "/backends" if user.role == "admin" else "/account"
        resp = web.HTTPSeeOther(next_path or home)
        resp.set_cookie(SESSION_COOKIE, cookie, httponly=True, samesite="Lax", max_age=12 * 3600,
                        secure=request.secure, path="/")
        resp.del_cookie(LOGIN_CSRF_COOKIE)
        raise resp

    async def logout(self, request: web.Request) -> web.Response:
        session = self.auth.session(request, time.time())
        if session is None:
            raise web.HTTPSeeOther("/")
        await self._form(request, session)
        self.auth.store.end_session(request.cookies.get(SESSION_COOKIE))
        resp = web.HTTPSeeOther("/")
        resp.del_cookie(SESSION_COOKIE, path="/")
        raise resp

    async def _dummy_hash(self) -> str:
        if self._dummy_password_hash is None:
            self._dummy_password_hash = await asyncio.to_thread(hash_password, new_password())
        return self._dummy_password_hash

    # ---- Backends ---------------------------------------------------------------------------------

    async def backends(self, request: web.Request) -> web.Response:
        now = time.time()
        if _wants_html(request):
            session = self.auth.page_user(request, now, admin=True)
            if request.query.get("rows") == "1":  # the page's live refresh: the table body only
                return self.render("backend_rows.html", members=self.backends_view())
            return self.render("backends.html", title="Backends", page="backends", session=session,
                               members=self.backends_view())
        self.auth.api_user(request, now, admin=True)
        return web.json_response({"gateway_id": self.gateway_id, "members": self.backends_view()})

    # ---- Config -----------------------------------------------------------------------------------

    def _config_view(self, session: Session, raw: dict[str, Any], errors: dict[str, str], saved: bool,
                     status: int = 200) -> web.Response:
        problem = self.pools_file.problem
        return self.render("config.html", status, title="Config", page="config", session=session,
                           errors=errors, saved=saved, path=str(self.pools_file.config_path),
                           problem=str(problem) if problem is not None else "",
                           **config_form.view_model(raw))

    async def config_page(self, request: web.Request) -> web.Response:
        session = self.auth.page_user(request, time.time(), admin=True)
        return self._config_view(session, self.pools_file.config_dict(), {}, saved=request.query.get("saved") == "1")

    async def config_save(self, request: web.Request) -> web.Response:
        session = self.auth.page_user(request, time.time(), admin=True)
        form = await self._form(request, session)
        result = config_form.from_form(form, self.pools_file.config_dict())
        errors = dict(result.errors)
        if not errors:
            problem = await self.pools_file.apply_config(result.raw)
            if problem is not None:
                errors[result.field_for(problem.key)] = problem.reason
        if errors:
            return self._config_view(session, result.raw, errors, saved=False, status=400)
        raise web.HTTPSeeOther("/admin/config/page?saved=1")

    # ---- Usage & costs ----------------------------------------------------------------------------

    async def _costs(self, timeout_s: float = COSTS_TIMEOUT_S) -> CostsReport:
        try:
            msg = await self.nc.request(subjects.ACCOUNTING_COSTS, encode_json(CostsQuery(days=30)),
                                      timeout=timeout_s)
        except Exception as exc:
            raise HTTPError(503, f"the accounting service did not answer ({type(exc).__name__}); is it running?",
                            code="accounting_unavailable", retry_after_s=5) from None
        try:
            return decode_json(msg.data, CostsReport)
        except ProtoDecodeError as exc:
            try:
                reason: object = msgspec.structs.asdict(decode_json(msg.data, ErrorReply).error)
            except ProtoDecodeError:
                reason = exc
        raise HTTPError(503, f"the accounting service failed: {reason}", code="accounting_failed")

    async def costs_page(self, request: web.Request) -> web.Response:
        session = self.auth.page_user(request, time.time(), admin=True)
        try:
            view = charts.costs_view(await self._costs())
        except HTTPError as err:
            return self.render("costs.html", 503, title="Usage & costs", page="costs", session=session,
                               error=err.message)
        return self.render("costs.html", title="Usage & costs", page="costs", session=session, error="", **view)

    async def costs_json(self, request: web.Request) -> web.Response:
        self.auth.api_user(request, time.time(), admin=True)
        return web.json_response(msgspec.to_builtins(await self._costs()))

    # ---- Users ------------------------------------------------------------------------------------

    def _users_view(self, session: Session, status: int = 200, created: str = "", error: str = "",
                    quota_saved: str = "", changed: str = "", quota_errors: dict[str, str] | None = None,
                    quota_values: dict[str, str] | None = None) -> web.Response:
        """``quota_errors``/``quota_values``: a refused quota form's reason and text, by key id."""
        now = time.time()
        keys = self.auth.store.keys_of(None)
        all_users = self.auth.store.users()
        names = {u.user_id: u.name for u in all_users}
        users = [{"user_id": u.user_id, "name": u.name, "role": u.role, "disabled": u.disabled,
                  "is_me": u.user_id == session.user.user_id,
                  "num_keys": sum(1 for k in keys if k.is_valid(now) and k.user_id == u.user_id)} for u in all_users]
        quota_errors, quota_values = quota_errors or {}, quota_values or {}
        usable = sorted((k for k in keys if k.is_valid(now)), key=lambda k: (names.get(k.user_id, ""), k.name))
        key_rows = [{"key_id": k.key_id, "user": names.get(k.user_id, "?"), "name": k.name, "hint": k.hint,
                     "rotated": k.replaced_by is not None, "used_today": self.auth.used_today(k.key_id, now),
                     "quota_text": quota_values.get(k.key_id, "" if k.daily_quota is None else str(k.daily_quota)),
                     "daily_quota": k.daily_quota, "error": quota_errors.get(k.key_id, "")} for k in usable]
        saved = self.auth.store.key_by_id(quota_saved) if quota_saved else None
        return self.render("users.html", status, title="Users", page="users", session=session, users=users,
                           keys=key_rows, created=created, error=error, quota_saved=saved, changed=changed)

    async def users_page(self, request: web.Request) -> web.Response:
        session = self.auth.page_user(request, time.time(), admin=True)
        return self._users_view(session, quota_saved=request.query.get("quota_saved", ""))

    async def key_quota(self, request: web.Request) -> web.Response:
        """An admin sets (or clears) any key's daily token quota; it applies to the key's next request."""
        session = self.auth.page_user(request, time.time(), admin=True)
        form = await self._form(request, session)
        key_id = request.match_info["key_id"]
        if self.auth.store.key_by_id(key_id) is None:
            raise HTTPError(404, "no such key", code="key_not_found")
        text = form.get("daily_quota", "")
        try:
            self.auth.store.set_quota(key_id, parse_daily_quota(text))
        except IdentityError as exc:
            return self._users_view(session, 400, quota_errors={key_id: exc.message}, quota_values={key_id: text})
        raise web.HTTPSeeOther(f"/admin/users?quota_saved={key_id}#key-{key_id}")

    async def _user_action(self, request: web.Request, act: Callable[[Session, str, dict[str, str]], str]
                           ) -> web.Response:
        """An admin's change to a user (role, disable, enable, delete): the store refuses what would leave no
        active admin; the page says what happened."""
        session = self.auth.page_user(request, time.time(), admin=True)
        form = await self._form(request, session)
        user_id = request.match_info["user_id"]
        if self.auth.store.user(user_id) is None:
            raise HTTPError(404, "no such user", code="user_not_found")
        try:
            done = act(session, user_id, form)
        except IdentityError as exc:
            return self._users_view(session, 400, error=exc.message)
        return self._users_view(session, changed=done)

    async def user_role(self, request: web.Request) -> web.Response:
        def act(session: Session, user_id: str, form: dict[str, str]) -> str:
            user = self.auth.store.set_role(user_id, form.get("role", ""))  # type: ignore[arg-type]  # set_role refuses a role not in ROLES
            return f"{user.name} is now {user.role}."
        return await self._user_action(request, act)

    async def user_disable(self, request: web.Request) -> web.Response:
        def act(session: Session, user_id: str, form: dict[str, str]) -> str:
            user = self.auth.store.set_disabled(user_id, True, time.time())
            return f"{user.name} is disabled: no sign-in, every key refused."
        return await self._user_action(request, act)

    async def user_enable(self, request: web.Request) -> web.Response:
        def act(session: Session, user_id: str, form: dict[str, str]) -> str:
            return f"{self.auth.store.set_disabled(user_id, False, time.time()).name} is enabled again."
        return await self._user_action(request, act)

    async def user_delete(self, request: web.Request) -> web.Response:
        def act(session: Session, user_id: str, form: dict[str, str]) -> str:
            user = self.auth.store.user(user_id)
            self.auth.store.delete_user(user_id, time.time())
            return f"{user.name if user else user_id} is deleted; their keys are revoked."
        return await self._user_action(request, act)

    async def admin_key_revoke(self, request: web.Request) -> web.Response:
        """An admin revokes any user's key (active or rotated in its grace period)."""
        session = self.auth.page_user(request, time.time(), admin=True)
        await self._form(request, session)
        key_id = request.match_info["key_id"]
        key = self.auth.store.key_by_id(key_id)
        if key is None:
            raise HTTPError(404, "no such key", code="key_not_found")
        self.auth.store.revoke_key(key_id, time.time())
        return self._users_view(session, changed=f"Key {key.name} ({key.key_id}) is revoked.")

    async def users_create(self, request: web.Request) -> web.Response:
        session = self.auth.page_user(request, time.time(), admin=True)
        form = await self._form(request, session)
        name, role = form.get("name", "").strip(), form.get("role", "user")
        try:
            check_user_name(name)
            check_password_rules(form.get("password", ""))
            pw_hash = await asyncio.to_thread(hash_password, form.get("password", ""))
            self.auth.store.create_user(name, pw_hash, role)  # type: ignore[arg-type]  # the form's text: create_user refuses a role not in ROLES
        except IdentityError as exc:
            return self._users_view(session, 400, error=f"{exc.field}: {exc.message}")
        return self._users_view(session, created=name)

    # ---- Limits (services/gateway/limits.py; the form ↔ limits mapping in limits_form.py) ----------------

    def _limit_targets(self, now: float) -> tuple[list[User], list[tuple[ApiKey, str]]]:
        """Every user; every usable key with its user's name (by user, then key name)."""
        users = self.auth.store.users()
        names = {u.user_id: u.name for u in users}
        keys = sorted((k for k in self.auth.store.keys_of(None) if k.is_valid(now)),
                      key=lambda k: (names.get(k.user_id, ""), k.name, k.key_id))
        return users, [(k, names.get(k.user_id, "?")) for k in keys]

    def _limits_view(self, session: Session, status: int = 200, saved: str = "", refused: str = "",
                     texts: dict[str, str] | None = None, errors: dict[str, str] | None = None) -> web.Response:
        """``refused``: the row (``user-<id>`` / ``key-<key_id>``) whose form was refused, with what it sent
        (``texts``) and the reason (``errors``), by kind."""
        now = time.time()
        book = self.auth.book
        energy_age_s = None if book.energy_as_of_s is None else now - book.energy_as_of_s

        def cells(row_id: str, limits: Limits, principal_id: str) -> list[dict[str, str]]:
            mine = row_id == refused
            return limits_form.cells(limits, book.spend(principal_id, now), energy_age_s,
                                     (texts or {}) if mine else {}, (errors or {}) if mine else {})

        users, keys = self._limit_targets(now)
        user_rows = [{"row_id": f"user-{u.user_id}", "action": f"/admin/limits/user/{u.user_id}", "name": u.name,
                      "role": u.role, "what": f"user {u.name}",
                      "cells": cells(f"user-{u.user_id}", self.auth.store.limits_of(user_principal(u.user_id)),
                                     user_principal(u.user_id))} for u in users]
        key_rows = [{"row_id": f"key-{k.key_id}", "action": f"/admin/limits/key/{k.key_id}", "user": user,
                     "name": k.name, "hint": k.hint, "key_id": k.key_id,
                     "lineage": k.lineage if k.lineage and k.lineage != k.key_id else "",
                     "what": f"key {k.name} ({k.key_id})",
                     "cells": cells(f"key-{k.key_id}", self.auth.store.key_limits(k),
                                    key_principal(k.lineage or k.key_id))}
                    for k, user in keys]
        saved_what = next((r["what"] for r in (*user_rows, *key_rows) if r["row_id"] == saved), "")
        return self.render("limits.html", status, title="Limits", page="limits", session=session, users=user_rows,
                           keys=key_rows, labels=list(limits_form.LABELS.values()), saved=saved_what,
                           refused=bool(errors),
                           energy_age=None if energy_age_s is None else limits_form.age_text(energy_age_s),
                           reserve_output_tokens=self.pools_file.file_config.limits.reserve_output_tokens,
                           energy_poll_s=self.key_energy_poll_s)

    def _limits_form_saved(self, session: Session, form: dict[str, str], row_id: str,
                           save: Callable[[dict[str, int | float | None]], object]) -> web.Response:
        values, errors = limits_form.from_form(form)
        if not errors:
            try:
                save(values)
            except IdentityError as exc:
                errors = {"tokens_per_day" if exc.field == "daily_quota" else exc.field: exc.message}
        if errors:
            texts: dict[str, str] = {kind: text for kind, text in form.items() if kind in KINDS}
            return self._limits_view(session, 400, refused=row_id, texts=texts, errors=errors)
        raise web.HTTPSeeOther(f"/admin/limits?saved={row_id}#{row_id}")

    async def limits_page(self, request: web.Request) -> web.Response:
        session = self.auth.page_user(request, time.time(), admin=True)
        return self._limits_view(session, saved=request.query.get("saved", ""))

    async def limits_user_save(self, request: web.Request) -> web.Response:
        session = self.auth.page_user(request, time.time(), admin=True)
        form = await self._form(request, session)
        user = self.auth.store.user(request.match_info["user_id"])
        if user is None:
            raise HTTPError(404, "no such user", code="user_not_found")
        principal = user_principal(user.user_id)
        return self._limits_form_saved(session, form, f"user-{user.user_id}",
                                       lambda values: self.auth.store.change_limits(principal, values))

    async def limits_key_save(self, request: web.Request) -> web.Response:
        session = self.auth.page_user(request, time.time(), admin=True)
        form = await self._form(request, session)
        key = self.auth.store.key_by_id(request.match_info["key_id"])
        if key is None:
            raise HTTPError(404, "no such key", code="key_not_found")
        return self._limits_form_saved(session, form, f"key-{key.key_id}",
                                       lambda values: self.auth.store.change_key_limits(key.key_id, values))

    def _user_json(self, user: User, now: float) -> dict[str, Any]:
        principal = user_principal(user.user_id)
        return {"user_id": user.user_id, "name": user.name, "role": user.role,
                "limits": limits_form.as_json(self.auth.store.limits_of(principal)),
                "spend": limits_form.spend_json(self.auth.book.spend(principal, now))}

    def _key_json(self, key: ApiKey, user: str, now: float) -> dict[str, Any]:
        lineage = key.lineage or key.key_id
        return {"key_id": key.key_id, "user": user, "name": key.name, "hint": key.hint, "lineage": lineage,
                "limits": limits_form.as_json(self.auth.store.key_limits(key)),
                "spend": limits_form.spend_json(self.auth.book.spend(key_principal(lineage), now))}

    async def limits_json(self, request: web.Request) -> web.Response:
        now = time.time()
        self.auth.api_user(request, now, admin=True)
        users, keys = self._limit_targets(now)
        return web.json_response({"users": [self._user_json(u, now) for u in users],
                                  "keys": [self._key_json(k, user, now) for k, user in keys],
                                  "energy_as_of_s": self.auth.book.energy_as_of_s})

    async def limits_json_put(self, request: web.Request) -> web.Response:
        """``{"user": NAME}`` or ``{"key_id": ID}`` and any of the five kinds (null clears, absent keeps)."""
        now = time.time()
        self.auth.api_user(request, now, admin=True)
        body = await read_json_object(request)
        try:
            target, name = limits_form.target_from_json(body)
            changes = limits_form.changes_from_json(body)
        except IdentityError as exc:
            code = ("invalid_limit" if exc.field in KINDS else
                    "invalid_target" if exc.field in limits_form.TARGET_FIELDS else "unknown_parameter")
            raise HTTPError(400, f"{exc.field}: {exc.message}", param=exc.field, code=code) from None
        if target == "user":
            user = next((u for u in self.auth.store.users() if u.name == name), None)
            if user is None:
                raise HTTPError(404, f"no user named {name!r}", param="user", code="user_not_found")
            self.auth.store.change_limits(user_principal(user.user_id), changes)
            return web.json_response(self._user_json(user, now))
        key = self.auth.store.key_by_id(name)
        if key is None:
            raise HTTPError(404, f"no key with id {name!r}", param="key_id", code="key_not_found")
        self.auth.store.change_key_limits(key.key_id, changes)
        key = self.auth.store.key_by_id(key.key_id) or key  # set_quota reloads the keys: the new quota
        owner = self.auth.store.user(key.user_id)
        return web.json_response(self._key_json(key, owner.name if owner else "?", now))

    # ---- a user's own keys ------------------------------------------------------------------------

    async def _own_usage(self, key_ids: list[str]) -> tuple[dict[str, dict[str, Any]], str]:
        """The accounting service's 30-day figures for these keys only, and why they are missing ("" if not)."""
        if not key_ids:
            return {}, ""
        try:
            data = await self._costs(OWN_USAGE_TIMEOUT_S)
        except HTTPError as err:
            return {}, err.message
        return charts.key_usage_view(data, key_ids), ""

    async def _account_view(self, session: Session, status: int = 200, new_key: str = "", new_key_name: str = "",
                            error: str = "") -> web.Response:
        now = time.time()
        own = self.auth.store.keys_of(session.user.user_id)
        usage, usage_error = await self._own_usage([k.key_id for k in own])
        keys = []
        for k in own:
            status_text = k.status(now)
            if status_text == "rotated" and k.expires_s is not None:  # "rotated" means expires_s is set
                status_text = f"rotated: works until {_utc(k.expires_s)}"
            # a key absent from the window had no traffic (0), unless the figures could not be fetched (unknown)
            window = usage.get(k.key_id) or ({} if usage_error else {"tokens": 0, "list_usd": 0.0, "energy_usd": 0.0})
            keys.append({"key_id": k.key_id, "name": k.name, "hint": k.hint, "status": status_text,
                         "active": k.is_valid(now) and k.replaced_by is None, "usable": k.is_valid(now),
                         "daily_quota": k.daily_quota,
                         "used_today": self.auth.used_today(k.key_id, now), "tokens_30d": window.get("tokens"),
                         "list_usd_30d": window.get("list_usd"), "energy_usd_30d": window.get("energy_usd")})
        totals = {field: _total(k[field] for k in keys) for field in ("tokens_30d", "list_usd_30d", "energy_usd_30d")}
        return self.render("account.html", status, title="My keys & usage", page="account", session=session,
                           keys=keys, totals=totals, usage_error=usage_error, new_key=new_key,
                           new_key_name=new_key_name, error=error, limits=self._own_limits(session, own, now))

    def _own_limits(self, session: Session, own: list[ApiKey], now: float) -> list[dict[str, str]]:
        """The limits that bind the signed-in user (its own, and each usable key's), with what counts
        against each now: a user sees why a 429 came before it comes."""
        book = self.auth.book
        energy_age_s = None if book.energy_as_of_s is None else now - book.energy_as_of_s
        targets = [("you (every key)", user_principal(session.user.user_id),
                    self.auth.store.limits_of(user_principal(session.user.user_id)))]
        targets += [(f"key {k.name}", key_principal(k.lineage or k.key_id), self.auth.store.key_limits(k))
                    for k in own if k.is_valid(now)]
        rows = []
        for who, principal, limits in targets:
            spend = book.spend(principal, now)
            for kind in KINDS:
                limit = limits.get(kind)
                if limit is not None:
                    rows.append({"who": who, "kind": limits_form.LABELS[kind],
                                 "spend": limits_form.spend_text(kind, spend[kind], limit, energy_age_s)})
        return rows

    async def account_page(self, request: web.Request) -> web.Response:
        return await self._account_view(self.auth.page_user(request, time.time(), admin=False))

    async def key_create(self, request: web.Request) -> web.Response:
        session = self.auth.page_user(request, time.time(), admin=False)
        form = await self._form(request, session)
        try:
            quota = parse_daily_quota(form.get("daily_quota", ""))
            if quota is not None and session.user.role != "admin":
                raise IdentityError("daily_quota", "only administrators set quotas")
            key, record = self.auth.store.create_key(session.user.user_id, form.get("name", ""), quota, time.time())
        except IdentityError as exc:
            return await self._account_view(session, 400, error=f"{exc.field}: {exc.message}")
        return await self._account_view(session, new_key=key, new_key_name=record.name)

    def _own_key(self, session: Session, key_id: str) -> None:
        key = self.auth.store.key_by_id(key_id)
        if key is None or (key.user_id != session.user.user_id and session.user.role != "admin"):
            raise HTTPError(404, "no such key", code="key_not_found")

    async def key_rotate(self, request: web.Request) -> web.Response:
        session = self.auth.page_user(request, time.time(), admin=False)
        form = await self._form(request, session)
        key_id = request.match_info["key_id"]
        self._own_key(session, key_id)
        try:
            try:
                grace_h = float(form.get("grace_hours", "") or GRACE_HOURS_DEFAULT)
            except ValueError:
                raise IdentityError("grace_hours", "must be a number of hours") from None
            key, record = self.auth.store.rotate_key(key_id, grace_h * 3600.0, time.time())
        except IdentityError as exc:
            return await self._account_view(session, 400, error=f"{exc.field}: {exc.message}")
        return await self._account_view(session, new_key=key, new_key_name=record.name)

    async def key_revoke(self, request: web.Request) -> web.Response:
        session = self.auth.page_user(request, time.time(), admin=False)
        await self._form(request, session)
        key_id = request.match_info["key_id"]
        self._own_key(session, key_id)
        self.auth.store.revoke_key(key_id, time.time())
        raise web.HTTPSeeOther("/account")


def _total(values: Any) -> float | None:
    """The sum of the known values; None when none is known (unknown, not 0)."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _utc(ts_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ts_s))
