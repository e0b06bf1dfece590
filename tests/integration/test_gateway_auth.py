"""Sign-in, sessions, CSRF, API keys and quotas on the real gateway (aiohttp client, real nats-server).

The browser flows are in tests/e2e/test_admin_pages.py; these check the rules route by route.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.parse

import aiohttp
import msgspec
import openai
import pytest

from proto import AuthCheck, SlotHeartbeat, SqlQuery, encode, encode_json, subjects
from proto import pools as pool_config
from services.common.http import serving
from services.gateway.auth import FREE_LOGIN_FAILURES
from services.gateway.identity import hash_password, key_digest
from services.gateway.service import GatewayConfig, GatewayService
from tests.integration.conftest import Stack, wait_for

ADMIN_PAGES = ["/backends", "/admin/config/page", "/admin/costs", "/admin/users"]
ADMIN_POSTS = ["/admin/config/page", "/admin/users", "/admin/keys/key_0123456789abcdef/quota",
               "/admin/keys/key_0123456789abcdef/revoke", "/admin/users/u_0123456789ab/role",
               "/admin/users/u_0123456789ab/disable", "/admin/users/u_0123456789ab/enable",
               "/admin/users/u_0123456789ab/delete"]
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
            page = await r.text()
            assert r.status == 200 and "My keys" in page
        # a user may not set a quota, not even on their own key, and not with a valid CSRF token
        uma = stack.gateway.identity.password_hash("uma")[0]  # type: ignore[index]
        _, own = stack.gateway.identity.create_key(uma.user_id, "mine", None, time.time())
        async with http.post(stack.base_url + f"/admin/keys/{own.key_id}/quota",
                             data={"csrf": _csrf(page), "daily_quota": "1000000"}, allow_redirects=False) as r:
            assert r.status == 403 and (await r.json())["error"]["code"] == "admin_required"
        assert stack.gateway.identity.key_by_id(own.key_id).daily_quota is None  # type: ignore[union-attr]


async def test_every_form_needs_its_csrf_token(stack: Stack) -> None:
    store = stack.gateway.identity
    key_id = store.lookup_key(key_digest(stack.api_key), time.time()).key_id  # type: ignore[union-attr]
    async with _jar() as http:
        assert (await _login(http, stack.base_url, "admin", stack.gateway.bootstrap[0])).status == 303  # type: ignore[index]
        for path in ["/account/keys", "/admin/config/page", "/admin/users", "/logout", f"/account/keys/{key_id}/rotate",
                     f"/account/keys/{key_id}/revoke", f"/admin/keys/{key_id}/quota"]:
            form = {"name": "x", "grace_hours": "0", "daily_quota": "5"}
            async with http.post(stack.base_url + path, data=form, allow_redirects=False) as r:
                assert r.status == 403, path
                assert (await r.json())["error"]["code"] == "csrf_failed"
            async with http.post(stack.base_url + path, data={**form, "csrf": "forged"}, allow_redirects=False) as r:
                assert r.status == 403, path
                assert (await r.json())["error"]["code"] == "csrf_failed"
        async with http.get(stack.base_url + "/account") as r:
            assert r.status == 200  # still signed in: the refused /logout did not end the session
    # none of the refused posts changed the key: not rotated, not revoked, no quota
    key = store.key_by_id(key_id)
    assert key is not None and key.is_valid(time.time()) and key.replaced_by is None and key.daily_quota is None
    assert [k.key_id for k in store.keys_of(key.user_id)] == [key_id]
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


async def test_forty_parallel_guesses_reach_the_password_check_at_most_the_free_number_of_times(
        stack: Stack) -> None:
    """Issue #25: the back-off was checked before the slow hash and recorded after it, so 40 parallel guesses
    were all checked and the right one among them got in. Reserved first, only FREE_LOGIN_FAILURES are."""
    _add_user(stack, "pam")
    async with _jar() as http:
        async with http.get(stack.base_url + "/") as resp:
            csrf = _csrf(await resp.text())

        async def guess(password: str) -> int:
            async with http.post(stack.base_url + "/login", data={"csrf": csrf, "name": "pam", "password": password},
                                 allow_redirects=False) as r:
                return r.status
        statuses = await asyncio.gather(*(guess(f"wrong-{i}") for i in range(39)), guess(PASSWORD))
    checked = [s for s in statuses if s in (401, 303)]
    assert len(checked) <= FREE_LOGIN_FAILURES, statuses
    assert statuses.count(429) >= 40 - FREE_LOGIN_FAILURES
    stack.gateway.auth.throttle.succeeded("127.0.0.1", "pam")


@pytest.mark.parametrize("target", ["/%09/evil.example", "/%0a/evil.example", "//evil.example", "/%5Cevil.example",
                                    "https://evil.example/", "/%0d%0a/evil.example", "/%20/evil.example"])
async def test_the_sign_in_redirect_never_leaves_the_site(stack: Stack, target: str) -> None:
    """Issue #25: ``/?next=/%09/evil.example`` → ``Location: //evil.example`` (yarl dropped the tab after the
    raw text was checked)."""
    name = f"nx{abs(hash(target)) % 10_000}"
    _add_user(stack, name)
    async with _jar() as http:
        async with http.get(stack.base_url + "/?next=" + target) as resp:
            html = await resp.text()
        async with http.post(stack.base_url + "/login", data={"csrf": _csrf(html), "name": name, "password": PASSWORD,
                                                             "next": urllib.parse.unquote(target)},
                             allow_redirects=False) as r:
            assert r.status == 303
            location = r.headers["Location"]
    assert location.startswith("/") and not location.startswith("//") and "evil" not in location, location


async def test_an_admin_manages_other_users_and_their_keys_from_the_users_page(stack: Stack) -> None:
    """Issue #25: an admin could not revoke another user's key, disable or delete a user, or change a role."""
    store = stack.gateway.identity
    _add_user(stack, "ned")
    ned = store.user_by_name("ned")
    assert ned is not None
    ned_key, ned_record = store.create_key(ned.user_id, "ned-key", None, time.time())
    spare, _ = store.create_key(ned.user_id, "spare", None, time.time())
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=ned_key, max_retries=0)
    await client.models.list()
    _add_user(stack, "ada", "admin")
    async with _jar() as http:
        assert (await _login(http, stack.base_url, "ada", PASSWORD)).status == 303
        async with http.get(stack.base_url + "/admin/users") as r:
            page = await r.text()
        csrf = _csrf(page)
        assert f'action="/admin/keys/{ned_record.key_id}/revoke"' in page
        assert f'action="/admin/users/{ned.user_id}/disable"' in page

        async def post(path: str, **fields: str) -> tuple[int, str]:
            async with http.post(stack.base_url + path, data={"csrf": csrf, **fields}) as r:
                return r.status, await r.text()
        status, page = await post(f"/admin/keys/{ned_record.key_id}/revoke")
        assert status == 200 and "is revoked" in page
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        spare_client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=spare, max_retries=0)
        status, page = await post(f"/admin/users/{ned.user_id}/disable")
        assert status == 200 and "ned is disabled" in page
        with pytest.raises(openai.AuthenticationError):  # every key of a disabled user is refused
            await spare_client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        async with _jar() as other:  # and they cannot sign in
            assert (await _login(other, stack.base_url, "ned", PASSWORD)).status == 403
        status, page = await post(f"/admin/users/{ned.user_id}/enable")
        assert status == 200 and "enabled again" in page
        status, page = await post(f"/admin/users/{ned.user_id}/role", role="admin")
        assert status == 200 and "ned is now admin" in page and store.user_by_name("ned").role == "admin"  # type: ignore[union-attr]
        status, page = await post(f"/admin/users/{ned.user_id}/delete")
        assert status == 200 and "is deleted" in page and store.user_by_name("ned") is None
        status, page = await post(f"/admin/users/{ned.user_id}/role", role="user")
        assert status == 400 and "no such user" in page
        await spare_client.close()
    await client.close()


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
    msg = await stack.gateway.nc.request(subjects.ACCOUNTING_SQL, encode_json(SqlQuery(sql=sql)), timeout=10)
    return msgspec.json.decode(msg.data)["rows"]


async def test_other_services_check_keys_over_the_bus(stack: Stack) -> None:
    async def check(digest: str) -> dict[str, object]:
        msg = await stack.gateway.nc.request(subjects.AUTH_CHECK, encode_json(AuthCheck(key_sha256=digest)),
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
            assert "chat" in stack.gateway.pools_file.file_config.pools
            saved = stack.gateway.pools_file.config_path.read_text()
            assert '"chat"' in saved and '"electricity_rate_usd_per_kwh": 0.2' in saved
            await wait_for(lambda: "chat" in replica.pools_file.file_config.pools)
            assert replica.pools_file.config_path.read_text() == saved
            # a bad value is refused next to its field and changes nothing
            bad = {**form, "csrf": csrf, "newpool.name": "", "pool.0.name": "chat", "pool.0.overflow_threshold": "7",
                   "pool.0.member.0.backend": "bus:w1", "pool.0.member.0.model_id": "tiny"}
            async with http.post(stack.base_url + "/admin/config/page", data=bad) as r:
                page = await r.text()
                assert r.status == 400
                assert 'id="err-pool.0.overflow_threshold"' in page and "must be in [0.0, 1.0]" in page
            assert stack.gateway.pools_file.config_path.read_text() == saved
            client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=stack.api_key, max_retries=0)
            reply = await client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "x"}],
                                                         max_tokens=2)
            assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        await other_nc.drain()


def _new_key(page: str) -> str:
    match = re.search(r'<code class="secret" id="new-key">(sk-[^<]+)</code>', page)
    assert match, page[:2000]
    return match.group(1)


def _row(page: str, attr: str, value: str) -> str:
    match = re.search(rf'<tr[^>]*{attr}="{re.escape(value)}"[^>]*>(.*?)</tr>', page, re.S)
    assert match, f"no row {attr}={value}"
    return match.group(1)


async def _chat(key: str, stack_url: str) -> openai.types.chat.ChatCompletion:
    client = openai.AsyncOpenAI(base_url=stack_url + "/v1", api_key=key, max_retries=0)
    return await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4)


async def test_an_admin_sets_a_users_key_quota_on_the_users_page_and_the_key_is_held_to_it(stack: Stack) -> None:
    store = stack.gateway.identity
    user = store.create_user("quinn", hash_password(PASSWORD), "user")
    key, record = store.create_key(user.user_id, "batch", None, time.time())
    quota_url = stack.base_url + f"/admin/keys/{record.key_id}/quota"
    async with _jar() as http:
        assert (await _login(http, stack.base_url, "admin", stack.gateway.bootstrap[0])).status == 303  # type: ignore[index]
        async with http.get(stack.base_url + "/admin/users") as r:
            page = await r.text()
        assert "quinn" in _row(page, "data-key-id", record.key_id)
        row = _row(page, "data-user", "quinn")
        assert '<td class="num">1</td>' in row and '<option value="user" selected>' in row  # one usable key, a user
        csrf = _csrf(page)
        for bad, reason in (("-3", "must not be negative"), ("1.5", "whole number"), ("0", "at least 1 token")):
            async with http.post(quota_url, data={"csrf": csrf, "daily_quota": bad}) as r:
                page = await r.text()
                assert r.status == 400, bad
            row = _row(page, "data-key-id", record.key_id)
            assert f'id="err-quota-{record.key_id}"' in row and reason in row and 'aria-invalid="true"' in row
            assert f'value="{bad}"' in row  # the refused text stays in its field, to be corrected
            assert store.key_by_id(record.key_id).daily_quota is None  # type: ignore[union-attr]
        async with http.post(quota_url, data={"csrf": csrf, "daily_quota": "12"}, allow_redirects=False) as r:
            assert r.status == 303 and r.headers["Location"].startswith(f"/admin/users?quota_saved={record.key_id}")
        async with http.get(stack.base_url + r.headers["Location"]) as r:
            page = await r.text()
        assert "set to 12 tokens" in page and 'value="12"' in _row(page, "data-key-id", record.key_id)
        assert store.key_by_id(record.key_id).daily_quota == 12  # type: ignore[union-attr]

        reply = await _chat(key, stack.base_url)  # 0 of 12 used: admitted, and it spends them
        assert reply.usage is not None and reply.usage.total_tokens >= 12
        with pytest.raises(openai.RateLimitError) as info:
            await _chat(key, stack.base_url)
        assert info.value.code == "quota_exceeded"
        assert 1 <= int(info.value.response.headers["Retry-After"]) <= 86_400  # until 00:00 UTC

        async with http.post(quota_url, data={"csrf": csrf, "daily_quota": ""}, allow_redirects=False) as r:
            assert r.status == 303  # empty: no quota
        assert store.key_by_id(record.key_id).daily_quota is None  # type: ignore[union-attr]
        assert (await _chat(key, stack.base_url)).usage is not None  # served again
        async with http.post(stack.base_url + "/admin/keys/key_nope/quota",
                             data={"csrf": csrf, "daily_quota": "5"}) as r:
            assert r.status == 404


async def test_rotating_a_key_on_the_account_page_keeps_the_old_key_serving_for_the_grace_window(
        stack: Stack) -> None:
    _add_user(stack, "rita")
    async with _jar() as http:
        assert (await _login(http, stack.base_url, "rita", PASSWORD)).status == 303
        async with http.get(stack.base_url + "/account") as r:
            csrf = _csrf(await r.text())
        async with http.post(stack.base_url + "/account/keys", data={"csrf": csrf, "name": "laptop"}) as r:
            first = _new_key(await r.text())
        first_id = stack.gateway.identity.lookup_key(key_digest(first), time.time()).key_id  # type: ignore[union-attr]
        async with http.post(stack.base_url + f"/account/keys/{first_id}/rotate",
                             data={"csrf": csrf, "grace_hours": "1"}) as r:
            page = await r.text()
            assert r.status == 200
        second = _new_key(page)
        assert second != first
        assert "rotated: works until" in _row(page, "data-key-id", first_id)
        # inside the grace window both keys serve
        assert (await _chat(first, stack.base_url)).choices[0].finish_reason in ("stop", "length")
        assert (await _chat(second, stack.base_url)).choices[0].finish_reason in ("stop", "length")
        # a rotation with no grace ends the replaced key at once (so the window above is what kept it alive)
        second_id = stack.gateway.identity.lookup_key(key_digest(second), time.time()).key_id  # type: ignore[union-attr]
        async with http.post(stack.base_url + f"/account/keys/{second_id}/rotate",
                             data={"csrf": csrf, "grace_hours": "0"}) as r:
            third = _new_key(await r.text())
        with pytest.raises(openai.AuthenticationError):
            await _chat(second, stack.base_url)
        assert (await _chat(third, stack.base_url)).usage is not None
        assert (await _chat(first, stack.base_url)).usage is not None  # still inside its own hour


async def test_a_users_page_shows_their_own_30_day_tokens_from_the_ledger(stack: Stack) -> None:
    store = stack.gateway.identity
    user = store.create_user("sam", hash_password(PASSWORD), "user")
    key, record = store.create_key(user.user_id, "notebook", None, time.time())
    _, idle = store.create_key(user.user_id, "spare", None, time.time())
    mine = await _chat(key, stack.base_url)
    await _chat(stack.api_key, stack.base_url)  # the admin's traffic: not sam's
    await wait_for(lambda: stack.accounting.stats.usage_ingested >= 2)
    async with _jar() as http:
        assert (await _login(http, stack.base_url, "sam", PASSWORD)).status == 303
        async with http.get(stack.base_url + "/account") as r:
            page = await r.text()
    assert mine.usage is not None
    expected = mine.usage.prompt_tokens + mine.usage.completion_tokens
    row = _row(page, "data-key-id", record.key_id)
    assert re.search(rf'data-field="tokens-30d">{expected:,}<', row), row
    assert re.search(r'data-field="tokens-30d">0<', _row(page, "data-key-id", idle.key_id))
    assert re.search(rf'id="own-usage">.*?data-field="tokens">{expected:,}<', page, re.S)  # sam's total only
    admin_key_id = store.lookup_key(key_digest(stack.api_key), time.time()).key_id  # type: ignore[union-attr]
    assert admin_key_id not in page


async def test_the_backends_page_says_no_signal_for_a_stock_engine_and_stale_for_old_data(  # type: ignore[no-untyped-def]
        nc, tmp_path) -> None:
    pools = pool_config.parse({"model_pools": {"mix": {"members": [
        {"model_id": "m", "backend": "http://127.0.0.1:9/v1", "id": "stock1"},  # telemetry: no lane figures
        {"model_id": "m", "backend": "bus:old1"},  # one heartbeat, then silence
        {"model_id": "m", "backend": "http://127.0.0.1:10/v1", "id": "silent"}]}}})  # never heard from
    gateway = GatewayService(nc, GatewayConfig(gateway_id="gwb", port=0, data_dir=tmp_path, stale_after_s=0.5), pools)

    def beat(worker: str, seq: int, **kw) -> bytes:  # type: ignore[no-untyped-def]
        return encode(SlotHeartbeat(worker_id=worker, session_id="s", seq=seq, ts_s=time.time(), model_id="m", **kw))

    async with gateway.running(), serving(gateway.app(), "127.0.0.1", 0) as url, _jar() as http:
        await nc.publish(subjects.heartbeat("old1"), beat("old1", 1, lanes=2, running=1, waiting=0))
        await nc.publish(subjects.heartbeat("stock1"), beat("stock1", 1, engine_kind="stock", backend="http"))
        await wait_for(lambda: gateway.fleet.record("old1").heartbeat is not None)
        await asyncio.sleep(0.5 + 0.1)  # old1 is past stale_after_s now
        await nc.publish(subjects.heartbeat("stock1"), beat("stock1", 2, engine_kind="stock", backend="http"))
        await wait_for(lambda: getattr(gateway.fleet.record("stock1").heartbeat, "seq", 0) == 2)
        assert (await _login(http, url, "admin", gateway.bootstrap[0])).status == 303  # type: ignore[index]
        async with http.get(url + "/backends", headers={"Accept": "text/html"}) as r:
            page = await r.text()
    stock, old, silent = (_row(page, "data-member", m) for m in ("stock1", "old1", "silent"))
    assert 'class="nosignal">no signal' in stock and "stale" not in stock
    assert 'class="stale">stale' in old and "no signal" not in old
    assert re.search(r'<td class="load">\d\.\d\d', old)  # lane figures: a load score (1 of 2 lanes busy)
    age_s = float(re.search(r'<td class="num">([\d.]+) s</td>', old).group(1))  # type: ignore[union-attr]
    assert age_s >= 0.5  # older than stale_after_s: that is what "stale" says
    # never heard from: nothing to go stale (routing scores it by its open requests), age unknown
    assert 'class="nosignal">no signal' in silent and "stale" not in silent
    assert '<td class="num">\u2013</td>' in silent
