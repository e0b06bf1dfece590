"""Issue #12 (6): nobody gets in who should not, and nothing secret reaches a log.

The gateway in process (pages, admin JSON, static files, sign-in; one pool with an HTTP member, so requests
are served and logged), and the accounting service in process for the SQL subject ``llm.v1.accounting.sql``
and for its HTTP endpoints, whose keys the gateway checks over the bus.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import inspect
import logging
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from services.accounting.service import AccountingConfig, AccountingService
from services.common.bus import connect, ensure_bus
from services.common.http import serving
from services.gateway import auth as auth_module
from services.gateway import identity as identity_module
from services.gateway.auth import LOGIN_CSRF_COOKIE, SESSION_COOKIE
from services.gateway.identity import hash_password
from tests.faults.conftest import WATCH, gateway_in_process, sql
from tests.faults.threaded import member_app

USER_PASSWORD = "bob-password-123"


async def _login(http: aiohttp.ClientSession, url: str, name: str, password: str,
                 session_cookie: str | None = None) -> tuple[int, str | None]:
    """Sign in through the form; returns the status and the new session cookie (None if refused)."""
    async with http.get(url + "/") as page:
        html = await page.text()
        nonce = page.cookies[LOGIN_CSRF_COOKIE].value
    token = re.search(r'name="csrf" value="([^"]+)"', html).group(1)  # type: ignore[union-attr]
    cookies = {LOGIN_CSRF_COOKIE: nonce}
    if session_cookie is not None:
        cookies[SESSION_COOKIE] = session_cookie
    async with http.post(url + "/login", data={"csrf": token, "name": name, "password": password, "next": ""},
                         headers={"Cookie": "; ".join(f"{k}={v}" for k, v in cookies.items())},
                         allow_redirects=False) as resp:
        morsel = resp.cookies.get(SESSION_COOKIE)
        return resp.status, morsel.value if morsel is not None else None


def _cookie(value: str) -> dict[str, str]:
    return {"Cookie": f"{SESSION_COOKIE}={value}"}


async def _csrf_of(http: aiohttp.ClientSession, url: str, cookie: str) -> str:
    async with http.get(url + "/account", headers=_cookie(cookie)) as page:
        return re.search(r'name="csrf" value="([^"]+)"', await page.text()).group(1)  # type: ignore[union-attr]


@pytest.mark.slow
async def test_admin_routes_static_files_csrf_and_sessions_let_no_one_in(
        nats_server, tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.DEBUG)
    async with serving(member_app(), "127.0.0.1", 0) as member_url, \
            gateway_in_process(nats_server.url, tmp_path / "gw", _pool(member_url)) as g, \
            aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        gw, url = g.gateway, g.url
        admin_password = gw.bootstrap[0]  # type: ignore[index]
        bob = gw.identity.create_user("bob", hash_password(USER_PASSWORD), "user")
        bob_key, _ = gw.identity.create_key(bob.user_id, "bob's", None, time.time())
        status, admin_cookie = await _login(http, url, "admin", admin_password)
        assert status == 303 and admin_cookie
        status, bob_cookie = await _login(http, url, "bob", USER_PASSWORD)
        assert status == 303 and bob_cookie

        # ---- every admin route: none, forged, a user's session, a user's key → never in ----------------
        admin_routes = sorted({(r.method, r.resource.canonical) for r in gw_app_routes(g)
                               if r.resource.canonical.startswith("/admin") or r.resource.canonical == "/backends"})
        assert len(admin_routes) >= 7
        token, _, _ = admin_cookie.partition(".")
        forged = {"no session": {}, "garbage cookie": _cookie("garbage"),
                  "unsigned token": _cookie(token + ".0000"), "non-ascii cookie": {"Cookie": "llmgw_session=a.\u00e9"},
                  "user session": _cookie(bob_cookie), "user API key": {"Authorization": f"Bearer {bob_key}"},
                  "bad key": {"Authorization": "Bearer sk-nope"}}
        tried = 0
        for method, route in admin_routes:
            path = re.sub(r"\{[^}]+\}", "key_0", route)  # a value for each path parameter ({key_id})
            for accept in ("text/html", "application/json"):
                for who, headers in forged.items():
                    async with http.request(method, url + path, headers={"Accept": accept, **headers}, data=b"x=1",
                                            allow_redirects=False) as resp:
                        tried += 1
                        text = await resp.text()
                        assert resp.status in (303, 401, 403), (method, path, who, resp.status, text[:200])
                        if resp.status == 303:
                            assert resp.headers["Location"].startswith("/"), resp.headers["Location"]
                        assert "Traceback" not in text
            async with http.request(method, url + path, headers={"Accept": "text/html", **_cookie(admin_cookie)},
                                    allow_redirects=False) as resp:
                assert resp.status != 401 and resp.status != 303  # the admin does get in (or a form error)

        # ---- static files: no path traversal --------------------------------------------------------
        secret = (tmp_path / "gw" / "identity" / "secret").read_text().strip()
        traversals = ["/static/../identity/secret", "/static/%2e%2e/identity/secret", "/static/..%2fidentity%2fsecret",
                      "/static/style.css/../../identity/secret", "/static/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
                      "/static//etc/passwd", "/static/..\\..\\identity\\secret", "/static/style.css%00.txt"]
        for path in traversals:
            async with http.get(url + path, allow_redirects=False) as resp:
                body = await resp.text()
                assert resp.status in (400, 404), (path, resp.status)
                assert secret not in body and "root:" not in body

        # ---- CSRF -----------------------------------------------------------------------------------
        form = {"name": "mallory", "role": "admin", "password": "mallory-password-1"}
        for csrf in (None, "wrong", "\u00e9\u00e9", await _csrf_of(http, url, bob_cookie)):
            data = dict(form) if csrf is None else {**form, "csrf": csrf}
            async with http.post(url + "/admin/users", data=data, headers=_cookie(admin_cookie),
                                 allow_redirects=False) as resp:
                assert resp.status == 403, (csrf, resp.status)
        assert "mallory" not in [u.name for u in gw.identity.users()]
        for cookie, token_value in ((None, "x.y"), ("n", "\u00e9.\u00e9"), ("n", gw.identity.sign_value("other"))):
            headers = {"Cookie": f"{LOGIN_CSRF_COOKIE}={cookie}"} if cookie else {}
            login_form = {"csrf": token_value, "name": "admin", "password": admin_password}
            async with http.post(url + "/login", data=login_form, headers=headers, allow_redirects=False) as resp:
                assert resp.status == 403 and SESSION_COOKIE not in resp.cookies

        # ---- session fixation: a planted or an old session id never survives a sign-in ----------------
        status, fresh = await _login(http, url, "bob", USER_PASSWORD, session_cookie="planted.by-attacker")
        assert status == 303 and fresh and fresh != "planted.by-attacker"
        status, again = await _login(http, url, "bob", USER_PASSWORD, session_cookie=fresh)
        assert again and again != fresh
        async with http.get(url + "/account", headers=_cookie(fresh), allow_redirects=False) as resp:
            assert resp.status == 303  # the session presented at sign-in was ended
        async with http.get(url + "/account", headers=_cookie(again), allow_redirects=False) as resp:
            assert resp.status == 200

        # ---- a flow that handles every secret, for the log check below --------------------------------
        csrf = await _csrf_of(http, url, again)
        async with http.post(url + "/account/keys", data={"csrf": csrf, "name": "k2"}, headers=_cookie(again)) as resp:
            new_key = re.search(r"sk-[A-Za-z0-9_-]{40}", await resp.text()).group(0)  # type: ignore[union-attr]
        await _login(http, url, "bob", "a-wrong-password")
        for key in (g.api_key, bob_key, new_key, "sk-" + "x" * 40):
            async with http.post(url + "/v1/chat/completions", json={"model": "nope", "messages": []},
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
                assert resp.status in (400, 401, 404)
        for key in (g.api_key, bob_key, new_key):  # served: the access log writes its line for each
            async with http.post(url + "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}",
                                                                                   "X-Session-Id": "s1"}) as resp:
                assert resp.status == 200, await resp.text()
        async with http.get(url + "/backends", headers={"Authorization": f"Bearer {g.api_key}",
                                                        "Accept": "application/json"}) as resp:
            assert resp.status == 200

    # ---- secrets never logged (the bootstrap print on stdout is the one allowed place) ----------------
    secrets_used = {"admin password": admin_password, "user password": USER_PASSWORD, "wrong password":
                    "a-wrong-password", "bootstrap key": g.api_key, "user key": bob_key, "new key": new_key,
                    "admin session": admin_cookie, "user session": again, "session token": token}
    for what, value in secrets_used.items():
        WATCH.add(what, value)  # the run-wide check (tests/faults/conftest.py) looks for them too
    logged = "\n".join(f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert caplog.records  # the check looks at a real log (DEBUG and up, every logger)
    served = [r for r in caplog.records if r.name == "llmgw.access" and "http=200" in r.getMessage()]
    assert len(served) >= 3, "the access lines of the served requests are among the records checked"
    leaked = [name for name, value in secrets_used.items() if value in logged]
    assert leaked == []
    printed = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("llmgw gateway: first start")]
    assert not [name for name, value in secrets_used.items() if any(value in ln for ln in printed)]
    print(f"\nFIGURES security: admin_route_attempts={tried} traversal_paths={len(traversals)} csrf_attempts=7"
          f" log_records_checked={len(caplog.records)} access_lines_200={len(served)} secrets={len(secrets_used)}"
          f" secrets_found_in_logs=0")


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def _pool(member_url: str) -> dict[str, Any]:
    return {"model_pools": {"m": {"members": [{"model_id": "m", "backend": member_url}]}}}


def gw_app_routes(g):  # type: ignore[no-untyped-def]
    return list(g.gateway.app().router.routes())


def test_api_keys_and_tokens_are_compared_without_timing_leaks() -> None:
    # A request's key is hashed and looked up by its SHA-256 digest in a dict: no byte-by-byte comparison
    # of the secret exists to time. Cookie signatures, CSRF tokens and password digests use compare_digest.
    bearer = inspect.getsource(auth_module.Auth.bearer_key)
    assert "lookup_key(key_digest(token)" in bearer
    assert "self._keys.get(digest)" in inspect.getsource(identity_module.IdentityStore.lookup_key)
    assert "hmac.compare_digest(digest, " in inspect.getsource(identity_module.verify_password)
    for fn in (identity_module.IdentityStore.session, identity_module.IdentityStore.check_signed,
               auth_module.Auth.check_csrf):
        source = inspect.getsource(fn)
        assert "compare_digest" in source and " == " not in source and " != " not in source, fn
    from services.gateway import pages
    login = inspect.getsource(pages.Pages.login)
    assert "compare_digest" in login and "token != " not in login


@contextlib.asynccontextmanager
async def running_accounting(nats_url: str, config: AccountingConfig) -> AsyncIterator[AccountingService]:
    """An accounting service in this process on its own bus connection, ready, stopped on exit."""
    nc = await connect(nats_url, "accounting")
    await ensure_bus(nc)
    accounting = AccountingService(nc, config)
    task = asyncio.create_task(accounting.run())
    try:
        await asyncio.wait_for(accounting.ready.wait(), 30)
        yield accounting
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await nc.close()


@pytest.mark.slow
async def test_the_sql_subject_allows_one_read_only_select_within_a_time_limit(nats_server, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    async with running_accounting(nats_server.url, AccountingConfig(
            db_path=tmp_path / "ledger.duckdb", query_timeout_s=1.0, fetch_timeout_s=0.2)):
        escapes = {
            "delete": "DELETE FROM requests",
            "insert": "INSERT INTO requests (request_id) VALUES ('x')",
            "drop": "DROP TABLE requests",
            "update in a CTE": "WITH x AS (UPDATE requests SET model = 'x' RETURNING *) SELECT * FROM x",
            "attach": f"ATTACH '{outside}.duckdb' AS o",
            "attach in select": f"SELECT * FROM (ATTACH '{outside}.duckdb')",
            "read_csv": "SELECT * FROM read_csv('/etc/passwd')",
            "read_text": "SELECT * FROM read_text('/etc/passwd')",
            "read_blob": "SELECT * FROM read_blob('/etc/hostname')",
            "glob": "SELECT * FROM glob('/*')",
            "copy out": f"COPY requests TO '{outside}.csv'",
            "export": f"EXPORT DATABASE '{outside}'",
            "install": "INSTALL httpfs",
            "load": "LOAD httpfs",
            "set": "SET enable_external_access = true",
            "pragma": "PRAGMA enable_external_access",
            "two statements": "SELECT 1; DROP TABLE requests",
            "select then delete": "SELECT 1; DELETE FROM requests",
            "checkpoint": "CHECKPOINT",
            "create": "CREATE TABLE t AS SELECT 1",
            "very long": "SELECT " + " + ".join(["1"] * 200_000),
        }
        for name, query in escapes.items():
            reply = await sql(nats_server.url, query)
            assert "error" in reply and "rows" not in reply, (name, reply)
        started = time.monotonic()
        reply = await sql(nats_server.url, "SELECT sum(hash(a.range * b.range)) FROM range(100000000) a, "
                                           "range(100000000) b")
        interrupted_after_s = time.monotonic() - started
        assert "error" in reply and "interrupted" in reply["error"], reply
        assert interrupted_after_s < 5.0
        reply = await sql(nats_server.url, "SELECT count(*) FROM requests")
        assert reply["rows"] == [[0]]  # still there, still answering
        assert not list(tmp_path.glob("outside*"))
        print(f"\nFIGURES sql-escapes: refused={len(escapes)} long_query_interrupted_after_s={interrupted_after_s:.2f}")


@pytest.mark.slow
async def test_accountings_http_endpoints_let_only_an_admin_key_in(nats_server, tmp_path: Path) -> None:
    """``POST /sql`` and ``GET /costs``: forged, malformed, wrong, revoked and user credentials are refused."""
    async with gateway_in_process(nats_server.url, tmp_path / "gw") as g:  # answers the key checks on the bus
        identity = g.gateway.identity
        bob = identity.create_user("bob", hash_password(USER_PASSWORD), "user")
        bob_key, _ = identity.create_key(bob.user_id, "bob's", None, time.time())
        admin = next(u for u in identity.users() if u.role == "admin")
        revoked_key, revoked = identity.create_key(admin.user_id, "old", None, time.time())
        identity.revoke_key(revoked.key_id, time.time())
        admin_password = g.gateway.bootstrap[0]  # type: ignore[index]
        for what, value in (("user key", bob_key), ("revoked admin key", revoked_key)):
            WATCH.add(what, value)
        async with running_accounting(nats_server.url,
                                      AccountingConfig(db_path=tmp_path / "ledger.duckdb", port=0)) as accounting:
            basic = base64.b64encode(f"admin:{admin_password}".encode()).decode()
            refused = {
                "no header": ({}, 401), "empty bearer": ({"Authorization": "Bearer "}, 401),
                "garbage": ({"Authorization": "Bearer garbage"}, 401),
                "Basic with the admin password": ({"Authorization": f"Basic {basic}"}, 401),
                "Token scheme with the admin key": ({"Authorization": f"Token {g.api_key}"}, 401),
                "the admin key without a scheme": ({"Authorization": g.api_key}, 401),
                "no space after Bearer": ({"Authorization": f"Bearer{g.api_key}"}, 401),
                "the admin key with a byte more": ({"Authorization": f"Bearer {g.api_key}x"}, 401),
                "the admin key cut short": ({"Authorization": f"Bearer {g.api_key[:-1]}"}, 401),
                "a wrong key": ({"Authorization": "Bearer sk-" + "A" * 40}, 401),
                "a revoked admin key": ({"Authorization": f"Bearer {revoked_key}"}, 401),
                "the key in another header": ({"X-API-Key": g.api_key}, 401),
                "a user's key": ({"Authorization": f"Bearer {bob_key}"}, 403),
            }
            tried = 0
            async with aiohttp.ClientSession() as http:
                for name, (headers, expected) in {**refused, "the admin key": (
                        {"Authorization": f"Bearer {g.api_key}"}, 200)}.items():
                    for method, path, body in (("POST", "/sql", {"sql": "SELECT count(*) FROM requests"}),
                                               ("GET", "/costs", None)):
                        async with http.request(method, accounting.url + path, json=body, headers=headers) as resp:
                            tried += 1
                            answer = await resp.json()
                            assert resp.status == expected, (name, path, resp.status, answer)
                            if expected == 200:
                                assert "error" not in answer and (path != "/sql" or answer["rows"] == [[0]])
                            else:
                                assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
            print(f"\nFIGURES accounting-auth: attempts={tried} refused={2 * len(refused)} admin_ok=2")
