"""Sign-in, sessions, CSRF, API keys and quotas on the real gateway (aiohttp client, real nats-server).

The browser flows are in tests/e2e/test_admin_pages.py; these check the rules route by route.
"""

from __future__ import annotations

import re

import aiohttp
import msgspec
import openai
import pytest

from proto import subjects
from services.gateway.identity import hash_password, key_digest
from tests.integration.conftest import Stack

ADMIN_PAGES = ["/backends", "/admin/config/page", "/admin/costs", "/admin/users"]
ADMIN_POSTS = ["/admin/config/page", "/admin/users"]
ADMIN_JSON = [("GET", "/backends"), ("GET", "/admin/costs.json"), ("POST", "/admin/routing/explain")]
PASSWORD = "a-long-password-1"


def _jar() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))  # unsafe: cookies for 127.0.0.1


def _csrf(html: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', html)
    assert match, html[:500]
    return match.group(1)


async def _login(http: aiohttp.ClientSession, base: str, name: str, password: str) -> aiohttp.ClientResponse:
    async with http.get(base + "/") as resp:
        csrf = _csrf(await resp.text())
    return await http.post(base + "/login", data={"csrf": csrf, "name": name, "password": password},
                           allow_redirects=False)


def _add_user(stack: Stack, name: str, role: str = "user") -> None:
    stack.gateway.identity.create_user(name, hash_password(PASSWORD), role)  # type: ignore[arg-type]


async def test_admin_routes_need_an_admin(stack: Stack) -> None:
    _add_user(stack, "uma")
    async with _jar() as http:
        for path in ADMIN_PAGES:  # no session: pages redirect to sign-in, JSON says 401
            async with http.get(stack.base_url + path, headers={"Accept": "text/html"}, allow_redirects=False) as r:
                assert r.status == 303 and r.headers["Location"].startswith("/?next="), path
        for path in ADMIN_POSTS:
            async with http.post(stack.base_url + path, data={"x": "1"}, allow_redirects=False) as r:
                assert r.status == 303, path
        for method, path in ADMIN_JSON:
            async with http.request(method, stack.base_url + path, json={}) as r:
                assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error", path
        # a user's session or key: 403 everywhere an admin is needed
        resp = await _login(http, stack.base_url, "uma", PASSWORD)
        assert resp.status == 303 and resp.headers["Location"] == "/account"
        for path in ADMIN_PAGES:
            async with http.get(stack.base_url + path, headers={"Accept": "text/html"}, allow_redirects=False) as r:
                assert r.status == 403, path
        for method, path in ADMIN_JSON:
            async with http.request(method, stack.base_url + path, json={}) as r:
                assert r.status == 403, path
        async with http.get(stack.base_url + "/account") as r:
            assert r.status == 200 and "My keys" in await r.text()


async def test_every_form_needs_its_csrf_token(stack: Stack) -> None:
    async with _jar() as http:
        assert (await _login(http, stack.base_url, "admin", stack.gateway.bootstrap[0])).status == 303  # type: ignore[index]
        for path in ["/account/keys", "/admin/config/page", "/admin/users", "/logout"]:
            async with http.post(stack.base_url + path, data={"name": "x"}, allow_redirects=False) as r:
                assert r.status == 403, path
                assert (await r.json())["error"]["code"] == "csrf_failed"
            async with http.post(stack.base_url + path, data={"name": "x", "csrf": "forged"},
                                 allow_redirects=False) as r:
                assert r.status == 403, path
    async with _jar() as http:  # the sign-in form too: a post without the form's token is refused
        async with http.post(stack.base_url + "/login", data={"name": "admin", "password": "x"}) as r:
            assert r.status == 403


async def test_wrong_passwords_back_off_and_login_rotates_the_session(stack: Stack) -> None:
    _add_user(stack, "vic")
    async with _jar() as http:
        for _ in range(3):
            resp = await _login(http, stack.base_url, "vic", "wrong-password")
            assert resp.status == 401
        resp = await _login(http, stack.base_url, "vic", PASSWORD)  # right password, but locked for a while
        assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1
    stack.gateway.auth.throttle.succeeded("127.0.0.1", "vic")
    async with _jar() as http:
        http.cookie_jar.update_cookies({"llmgw_session": "attacker-chosen.value"})
        resp = await _login(http, stack.base_url, "vic", PASSWORD)
        assert resp.status == 303
        cookie = resp.cookies["llmgw_session"]
        assert cookie.value != "attacker-chosen.value" and cookie["httponly"] and cookie["samesite"] == "Lax"
        async with http.get(stack.base_url + "/account") as r:
            csrf = _csrf(await r.text())
        async with http.post(stack.base_url + "/logout", data={"csrf": csrf}, allow_redirects=False) as r:
            assert r.status == 303
        assert stack.gateway.identity.session(cookie.value, 2e9) is None  # revoked on the server


async def test_keys_revocation_and_quota(stack: Stack) -> None:
    store = stack.gateway.identity
    user = store.create_user("wes", hash_password(PASSWORD), "user")
    key, record = store.create_key(user.user_id, "k", 12, 0.0)
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0)
    reply = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4)
    assert reply.usage is not None and reply.usage.total_tokens >= 12  # the quota is spent now
    with pytest.raises(openai.RateLimitError) as info:
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "quota_exceeded"
    assert int(info.value.response.headers["Retry-After"]) >= 1
    store.revoke_key(record.key_id, 1.0)
    with pytest.raises(openai.AuthenticationError):
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    anonymous = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="sk-guess", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await anonymous.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    async with aiohttp.ClientSession() as http, http.post(stack.base_url + "/v1/chat/completions", json={}) as r:
        assert r.status == 401 and (await r.json())["error"]["code"] == "missing_api_key"


async def test_usage_is_attributed_to_the_key_id_never_the_key(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
    await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    from tests.integration.conftest import wait_for

    await wait_for(lambda: stack.accounting.stats.usage_ingested >= 1)
    rows = await _rows(stack, "select api_key_id from requests")
    key_id = stack.gateway.identity.lookup_key(key_digest(stack.api_key), 1.0).key_id  # type: ignore[union-attr]
    assert rows == [[key_id]] and stack.api_key not in repr(rows)


async def _rows(stack: Stack, sql: str) -> list[list[object]]:
    msg = await stack.gateway.nc.request(subjects.ACCOUNTING_SQL, msgspec.json.encode({"sql": sql}), timeout=10)
    return msgspec.json.decode(msg.data)["rows"]


async def test_other_services_check_keys_over_the_bus(stack: Stack) -> None:
    async def check(digest: str) -> dict[str, object]:
        msg = await stack.gateway.nc.request(subjects.AUTH_CHECK, msgspec.json.encode({"key_sha256": digest}),
                                             timeout=5)
        return msgspec.json.decode(msg.data)

    reply = await check(key_digest(stack.api_key))
    assert reply["ok"] is True and reply["role"] == "admin" and reply["user"] == "admin"
    assert await check(key_digest("sk-nope")) == {"ok": False}
    msg = await stack.gateway.nc.request(subjects.AUTH_CHECK, b"not json", timeout=5)
    assert msgspec.json.decode(msg.data) == {"ok": False}


async def test_trusted_network_needs_no_key(nc, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from services.common.http import serving
    from services.gateway.service import GatewayConfig, GatewayService

    gateway = GatewayService(nc, GatewayConfig(gateway_id="gwt", port=0, data_dir=tmp_path,
                                               trusted_networks=("127.0.0.0/8",)))
    async with gateway.running(), serving(gateway.app(), "127.0.0.1", 0) as url, aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions", json={"model": "ghost", "messages": [
                {"role": "user", "content": "x"}]}) as r:
            assert r.status == 404  # past auth: the model is what is missing
        async with http.get(url + "/backends") as r:
            assert r.status == 401  # trust covers inference only, never the admin routes


async def test_a_saved_config_is_applied_here_and_by_every_other_gateway(stack: Stack, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from services.common.bus import connect
    from services.gateway.service import GatewayConfig, GatewayService
    from tests.integration.conftest import wait_for

    other_nc = await connect(stack.nats_url, "gw2")
    replica = GatewayService(other_nc, GatewayConfig(gateway_id="gw2", port=0, data_dir=tmp_path / "gw2"))
    try:
        async with replica.running(), _jar() as http:
            assert (await _login(http, stack.base_url, "admin", stack.gateway.bootstrap[0])).status == 303  # type: ignore[index]
            async with http.get(stack.base_url + "/admin/config/page") as r:
                csrf = _csrf(await r.text())
            form = {"csrf": csrf, "newpool.name": "chat", "newpool.backend": "bus:w1", "newpool.model_id": "tiny",
                    "electricity_rate_usd_per_kwh": "0.2"}
            async with http.post(stack.base_url + "/admin/config/page", data=form) as r:
                assert r.status == 200 and "Saved to" in await r.text()
            assert "chat" in stack.gateway.file_config.pools
            saved = stack.gateway.config_path.read_text()
            assert '"chat"' in saved and '"electricity_rate_usd_per_kwh": 0.2' in saved
            await wait_for(lambda: "chat" in replica.file_config.pools)
            assert replica.config_path.read_text() == saved
            # a bad value is refused next to its field and changes nothing
            bad = {**form, "csrf": csrf, "newpool.name": "", "pool.0.name": "chat", "pool.0.overflow_threshold": "7",
                   "pool.0.member.0.backend": "bus:w1", "pool.0.member.0.model_id": "tiny"}
            async with http.post(stack.base_url + "/admin/config/page", data=bad) as r:
                page = await r.text()
                assert r.status == 400
                assert 'id="err-pool.0.overflow_threshold"' in page and "must be in [0.0, 1.0]" in page
            assert stack.gateway.config_path.read_text() == saved
            client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
            reply = await client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "x"}],
                                                         max_tokens=2)
            assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        await other_nc.drain()
