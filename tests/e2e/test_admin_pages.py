"""The admin pages in a real headless Chromium (Debian's /usr/bin/chromium driven by Playwright), and
the gateway's identity commands as real subprocesses.

One in-process stack (real nats-server, two tiny engine workers, accounting, the gateway on loopback);
each browser test walks a page as an operator would and saves a screenshot to ``test-artifacts/`` (set
LLMGW_SCREENSHOTS_TO_DOCS=1 to refresh the copies in docs/img/). The subprocess tests run ``llmgw
gateway`` and ``llmgw admin`` on one data dir, as an operator would on a host.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest

from proto import EnergyReading, EnergySample, encode, subjects
from proto import pools as pool_config
from services.accounting.service import AccountingConfig, AccountingService
from services.common.bus import connect, ensure_bus
from services.common.http import serving
from services.common.nats_server import EmbeddedNatsServer
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.serve.async_engine import AsyncEngine
from services.engine.serve.worker import BusWorker, WorkerConfig
from services.gateway.identity import hash_password
from services.gateway.load_score import stale_limit_s
from services.gateway.service import GatewayConfig, GatewayService
from tests.e2e.procs import REPO, Followed
from tests.integration.conftest import wait_for

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("LLMGW_TEST_ARTIFACTS", REPO / "test-artifacts"))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]

# Under CI (.ci/run sets LLMGW_CI=1 and installs chromium) a missing browser fails instead of skipping.
needs_chromium = pytest.mark.skipif(not Path(CHROMIUM).exists() and os.environ.get("LLMGW_CI") != "1",
                                    reason="needs Debian's chromium (scripts/install-test-tools.sh installs it)")
PHONE = {"width": 390, "height": 844}
LAPTOP = {"width": 1200, "height": 800}
# Days (back from today, UTC) with energy readings for w1 in the costs test, and the kWh of each; the
# days between (4, 10 and older) have none, so the chart shows "no data" there, not 0.
ENERGY_KWH = {0: 0.12, 1: 0.31, 2: 0.27, 3: 0.35, 5: 0.22, 6: 0.4, 7: 0.18, 8: 0.29, 9: 0.33}


@dataclass
class Site:
    url: str
    gateway: GatewayService
    accounting: AccountingService
    password: str
    page: object  # playwright Page
    nc: object  # a bus connection of the test's own
    workers: dict[str, asyncio.Task[None]]


async def _shot(page, name: str, to_docs: bool = True) -> None:  # type: ignore[no-untyped-def]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    await page.screenshot(path=str(path), full_page=True)
    if to_docs and os.environ.get("LLMGW_SCREENSHOTS_TO_DOCS") == "1":
        shutil.copy(path, REPO / "docs" / "img" / f"{name}.png")


@pytest.fixture
async def site(nats_server: EmbeddedNatsServer, tiny_model: Path, tmp_path: Path) -> AsyncIterator[Site]:
    from playwright.async_api import async_playwright

    async with contextlib.AsyncExitStack() as es:
        tasks: list[asyncio.Task[None]] = []
        ncs = []
        for name in ("w1", "w2", "accounting", "gateway", "test"):
            c = await connect(nats_server.url, name)
            ncs.append(c)
            es.push_async_callback(c.drain)
        await ensure_bus(ncs[3])
        workers = {}
        for wid, nc in zip(("w1", "w2"), ncs, strict=False):
            core = EngineCore(EngineConfig(model_path=tiny_model, model_id="tiny", kv_capacity_tokens=4096,
                                           max_concurrency=2, max_pending_requests=8))
            engine = await es.enter_async_context(AsyncEngine(core))
            workers[wid] = asyncio.create_task(BusWorker(nc, engine, WorkerConfig(worker_id=wid,
                                                                                  heartbeat_interval_s=0.2)).run())
            tasks.append(workers[wid])
        accounting = AccountingService(ncs[2], AccountingConfig(db_path=tmp_path / "ledger.duckdb",
                                                                fetch_timeout_s=0.2))
        tasks.append(asyncio.create_task(accounting.run()))
        file_config = pool_config.parse({"model_pools": {"tiny": {"members": [
            {"model_id": "tiny", "backend": "bus:w1"}, {"model_id": "tiny", "backend": "bus:w2"}],
            "cache_affinity": False, "sticky_bias": 0.0}}})
        gateway = GatewayService(ncs[3], GatewayConfig(gateway_id="gw1", port=0, data_dir=tmp_path), file_config)
        await es.enter_async_context(gateway.running())

        async def stop() -> None:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        es.push_async_callback(stop)
        url = await es.enter_async_context(serving(gateway.app(), "127.0.0.1", 0))
        await wait_for(lambda: all(gateway.fleet.record(w).heartbeat is not None for w in ("w1", "w2")))
        pw = await es.enter_async_context(async_playwright())
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        es.push_async_callback(browser.close)
        page = await browser.new_page(viewport=LAPTOP)
        assert gateway.bootstrap is not None
        yield Site(url, gateway, accounting, gateway.bootstrap[0], page, ncs[4], workers)


async def _sign_in(site: Site) -> None:
    page = site.page
    await page.goto(site.url + "/")  # type: ignore[attr-defined]
    await _shot(page, "admin-signin")
    await page.fill("#name", "admin")  # type: ignore[attr-defined]
    await page.fill("#password", site.password)  # type: ignore[attr-defined]
    await page.click("button[type=submit]")  # type: ignore[attr-defined]
    await page.wait_for_url("**/backends")  # type: ignore[attr-defined]


async def _publish_energy(nc, worker: str = "w1") -> int:  # type: ignore[no-untyped-def]
    """Energy readings for ``worker`` on the days of ENERGY_KWH: one session per day, a counter rising
    by that day's kWh between two samples an hour apart (today: inside the part of today gone by)."""
    js = nc.jetstream()
    now = time.time()
    midnight = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
    num = 0
    for days_ago, kwh in ENERGY_KWH.items():
        if days_ago == 0:
            start, end = midnight + (now - midnight) * 0.2, midnight + (now - midnight) * 0.8
        else:
            start = midnight - days_ago * 86_400 + 9 * 3600
            end = start + 3600
        for seq, (ts_s, counter_mj) in enumerate(((start, 0), (end, round(kwh * 3.6e9))), start=1):
            reading = EnergyReading(device_id="GPU-0", kind="nvml", method="counter", energy_mj=counter_mj)
            sample = EnergySample(worker_id=worker, session_id=f"day-{days_ago}", seq=seq, ts_s=ts_s,
                                  model_id="tiny", readings=[reading])
            await js.publish(subjects.energy(worker), encode(sample))
            num += 1
    return num


# Elements sticking out past the viewport's right edge, other than inside a horizontally scrolling
# wrapper (a wide table or the chart may scroll sideways on a phone; the page itself must not).
OVERFLOWING = """() => [...document.querySelectorAll('body *')].filter(e => {
    if (e.closest('.table-wrap, .chart-wrap')) return false;
    return e.getBoundingClientRect().right > document.documentElement.clientWidth + 1;
}).map(e => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '') + ' ' + Math.round(e.getBoundingClientRect().right))"""


async def _phone_width_problems(page) -> list[str]:  # type: ignore[no-untyped-def]
    """Why the page is wider than a phone's 390 px (nothing when it fits)."""
    width = await page.evaluate("document.documentElement.scrollWidth")
    if width <= PHONE["width"] + 1:
        return []
    return [f"{width} px wide", *(await page.evaluate(OVERFLOWING))[:8]]


@needs_chromium
async def test_sign_in_see_backends_then_create_a_key_and_use_it(site: Site) -> None:
    page = site.page
    await _sign_in(site)
    assert await page.locator("tr[data-member=w1]").count() == 1  # type: ignore[attr-defined]
    await page.wait_for_selector("tr[data-member=w2] .load svg.spark", timeout=10_000)  # type: ignore[attr-defined]
    await _shot(page, "admin-backends")

    await page.click("text=My keys")  # type: ignore[attr-defined]
    await page.fill("input[name=name]", "notebook")  # type: ignore[attr-defined]
    await page.click("text=Create key")  # type: ignore[attr-defined]
    key = (await page.text_content("#new-key")).strip()  # type: ignore[attr-defined]
    assert key.startswith("sk-")
    await _shot(page, "admin-account")
    client = openai.AsyncOpenAI(base_url=site.url + "/v1", api_key=key, max_retries=0)
    reply = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")

    await page.goto(site.url + "/account")  # type: ignore[attr-defined]  # (a reload would re-post the form)
    row = page.locator("#keys tr", has_text="notebook")  # type: ignore[attr-defined]
    assert int((await row.locator("td.num").first.text_content()).replace(",", "")) == reply.usage.total_tokens
    await row.locator("text=Revoke").click()
    with pytest.raises(openai.AuthenticationError):
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])

    await page.click("text=Sign out")  # type: ignore[attr-defined]
    await page.goto(site.url + "/admin/config/page")  # type: ignore[attr-defined]
    assert "/?next=" in page.url  # type: ignore[attr-defined]


@needs_chromium
async def test_editing_a_pool_weight_changes_routing(site: Site) -> None:
    page = site.page
    admin_key = site.gateway.bootstrap[1]  # type: ignore[index]
    client = openai.AsyncOpenAI(base_url=site.url + "/v1", api_key=admin_key, max_retries=0)

    async def winner() -> str:
        import aiohttp

        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {admin_key}"}) as http, http.post(
                site.url + "/admin/routing/explain", json={"model": "tiny", "messages": [
                    {"role": "user", "content": "x"}]}) as resp:
            return (await resp.json())["member"]

    assert await winner() == "w1"  # equal weights, both idle: the lower id
    await _sign_in(site)
    await page.goto(site.url + "/admin/config/page")  # type: ignore[attr-defined]
    await page.fill("input[name='pool.0.member.1.capacity_weight']", "8")  # type: ignore[attr-defined]
    await page.click("text=Save and apply")  # type: ignore[attr-defined]
    await page.wait_for_selector("text=Saved to")  # type: ignore[attr-defined]
    await _shot(page, "admin-config")
    assert await winner() == "w2"  # the heavier member now wins the tie
    before = dict(site.gateway.metrics.requests)
    await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    served = {k for k, n in site.gateway.metrics.requests.items() if n != before.get(k, 0)}
    assert served == {("tiny", "w2", "ok")}

    await page.fill("input[name='pool.0.overflow_threshold']", "3")  # type: ignore[attr-defined]
    await page.click("text=Save and apply")  # type: ignore[attr-defined]
    error = page.locator("#err-pool\\.0\\.overflow_threshold")  # type: ignore[attr-defined]
    assert "must be in [0.0, 1.0]" in await error.text_content()


@needs_chromium
async def test_costs_page_fills_after_traffic(site: Site) -> None:
    page = site.page
    num_samples = await _publish_energy(site.nc)
    client = openai.AsyncOpenAI(base_url=site.url + "/v1", api_key=site.gateway.bootstrap[1],  # type: ignore[index]
                                max_retries=0)
    for _ in range(3):
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                             max_tokens=4)
    await wait_for(lambda: site.accounting.stats.usage_ingested >= 3)
    await wait_for(lambda: site.accounting.stats.energy_ingested >= num_samples)
    await _sign_in(site)
    await page.goto(site.url + "/admin/costs")  # type: ignore[attr-defined]
    row = page.locator("#by-model tr", has_text="tiny")  # type: ignore[attr-defined]
    assert await row.count() == 1
    output_tokens = int((await row.locator("td.num").nth(2).text_content()).replace(",", ""))
    assert output_tokens > 0
    # the chart: a kWh bar and a $ point for each day with readings, a dashed "no data" box for the others
    chart = page.locator("svg.chart")  # type: ignore[attr-defined]
    assert await chart.count() == 1
    assert await chart.locator("rect.kwh").count() == len(ENERGY_KWH)
    assert await chart.locator("circle.usd").count() == len(ENERGY_KWH)
    assert await chart.locator("rect.missing").count() == 30 - len(ENERGY_KWH)
    assert await chart.locator("polyline.usd").count() >= 1
    # its table twin: today's row carries today's kWh, a day without readings says so
    today = dt.datetime.now(dt.UTC).date()
    cells = page.locator("#daily tr", has_text=today.isoformat()).locator("td")  # type: ignore[attr-defined]
    assert (await cells.nth(1).text_content()).strip() == f"{ENERGY_KWH[0]:.4f}"
    no_data_day = (today - dt.timedelta(days=4)).isoformat()
    no_data = page.locator("#daily tr", has_text=no_data_day).locator("td")  # type: ignore[attr-defined]
    assert (await no_data.nth(1).text_content()).strip() == "no data"
    w1 = page.locator("#by-member tr", has_text="w1").locator("td.num")  # type: ignore[attr-defined]
    assert float((await w1.nth(3).text_content()).strip()) == pytest.approx(sum(ENERGY_KWH.values()), abs=1e-4)
    await _shot(page, "admin-costs")
    await page.goto(site.url + "/admin/users")  # type: ignore[attr-defined]
    await _shot(page, "admin-users")


@needs_chromium
async def test_backends_rows_refresh_live_and_a_silent_member_turns_stale(site: Site) -> None:
    page = site.page
    await _sign_in(site)
    w2 = page.locator("tr[data-member=w2]")  # type: ignore[attr-defined]
    assert await w2.locator(".stale").count() == 0
    await page.evaluate("window.notReloaded = true")  # type: ignore[attr-defined]
    site.workers["w2"].cancel()  # w2's heartbeats stop (after a last one saying "stopped")
    await asyncio.gather(site.workers["w2"], return_exceptions=True)
    # stale once its last heartbeat is older than two of its 0.2 s intervals plus slack (docs/routing.md);
    # the page shows it at its next refresh (every 2 s)
    limit_s = stale_limit_s(site.gateway.fleet.record("w2").heartbeat, site.gateway.pools_file.stale_after_s)
    await page.wait_for_selector("tr[data-member=w2] .stale", timeout=(limit_s + 2 + 3) * 1000)  # type: ignore[attr-defined]
    assert await page.evaluate("window.notReloaded === true")  # type: ignore[attr-defined]  # rows swapped in place
    age_s = float((await w2.locator("td.num").nth(4).text_content()).removesuffix(" s").replace(",", ""))
    assert age_s >= limit_s - 0.05  # shown to 0.1 s
    assert await page.locator("tr[data-member=w1] .stale").count() == 0  # type: ignore[attr-defined]  # still beating


@needs_chromium
async def test_every_page_fits_a_phone_screen(site: Site) -> None:
    page = site.page
    await page.set_viewport_size(PHONE)  # type: ignore[attr-defined]
    await page.goto(site.url + "/")  # type: ignore[attr-defined]
    problems = {"sign-in": await _phone_width_problems(page)}
    await _shot(page, "phone-signin", to_docs=False)
    await page.fill("#name", "admin")  # type: ignore[attr-defined]
    await page.fill("#password", site.password)  # type: ignore[attr-defined]
    await page.click("button[type=submit]")  # type: ignore[attr-defined]
    await page.wait_for_url("**/backends")  # type: ignore[attr-defined]
    await page.wait_for_selector("tr[data-member=w2] .load svg.spark", timeout=10_000)  # type: ignore[attr-defined]
    problems["backends"] = await _phone_width_problems(page)
    await _shot(page, "admin-backends-phone")
    for name, path in (("config", "/admin/config/page"), ("costs", "/admin/costs"), ("users", "/admin/users"),
                       ("limits", "/admin/limits"), ("account", "/account")):
        await page.goto(site.url + path)  # type: ignore[attr-defined]
        problems[name] = await _phone_width_problems(page)
        await _shot(page, f"phone-{name}", to_docs=False)
    assert {name: why for name, why in problems.items() if why} == {}
    assert len(problems) == 7


# ---- the identity commands as subprocesses ------------------------------------------------------------

GATEWAY_READY = "llmgw gateway ready: listening on "
PASSWORD = "a-long-password-1"


def _llmgw(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=REPO, input=stdin,
                          capture_output=True, text=True, timeout=60)


@contextlib.contextmanager
def _gateway(nats_url: str, data: Path) -> Iterator[tuple[str, Followed]]:
    """``llmgw gateway`` on ``data`` until the block ends (then Ctrl-C, and it must exit cleanly)."""
    # Buffered stdout: print() then writes a line in one piece, never split by a log line on stderr
    # (unbuffered, "…:36821" and a log line's "2026-…" can end up on one line of the merged output).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    gw = Followed([sys.executable, "-m", "services.cli", "gateway", "--nats", nats_url, "--port", "0",
                   "--data-dir", str(data), "--gateway-id", "gw-e2e"], marker=GATEWAY_READY, env=env)
    try:
        yield gw.wait_ready(60).split(GATEWAY_READY, 1)[1].split()[0], gw
    finally:
        gw.proc.send_signal(signal.SIGINT)
        try:
            gw.proc.wait(30)
        except subprocess.TimeoutExpired:
            gw.proc.kill()
            raise
        gw.reader.join(5)
    assert gw.proc.returncode == 0, gw.output[-3000:]


async def _signed_in(http: aiohttp.ClientSession, url: str, name: str, password: str) -> tuple[int, str]:
    """POST the sign-in form as a browser would; (status, Location). The session cookie stays in ``http``."""
    async with http.get(url + "/") as r:
        csrf = re.search(r'name="csrf" value="([^"]+)"', await r.text()).group(1)  # type: ignore[union-attr]
    async with http.post(url + "/login", data={"csrf": csrf, "name": name, "password": password},
                         allow_redirects=False) as r:
        return r.status, r.headers.get("Location", "")


def _jar() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))  # unsafe: cookies for 127.0.0.1


async def test_a_first_start_prints_the_bootstrap_admin_once_and_a_restart_does_not(
        nats_server: EmbeddedNatsServer, tmp_path: Path) -> None:
    data = tmp_path / "gw"
    with _gateway(nats_server.url, data) as (url, first):
        line = first.line_with("first start")
        password = re.search(r"\(password (\S+)\)", line).group(1)  # type: ignore[union-attr]
        key = re.search(r"API key (sk-\S+);", line).group(1)  # type: ignore[union-attr]
        async with _jar() as http:
            assert await _signed_in(http, url, "admin", password) == (303, "/backends")
    assert sum("first start" in ln for ln in first.lines) == 1
    # while it is stopped, an operator sets the bootstrap key's quota from the shell
    listed = _llmgw("admin", "list-keys", "--data-dir", str(data))
    assert listed.returncode == 0, listed.stderr
    key_id, user, name = listed.stdout.split("\t")[:3]
    assert (user, name) == ("admin", "bootstrap")
    quota = _llmgw("admin", "set-quota", key_id, "5000", "--data-dir", str(data))
    assert quota.returncode == 0 and "set to 5,000 tokens" in quota.stdout, quota.stderr

    with _gateway(nats_server.url, data) as (url, second):
        async with _jar() as http:
            assert await _signed_in(http, url, "admin", password) == (303, "/backends")  # the same admin
            async with http.get(url + "/admin/users") as r:
                users_page = await r.text()
        row = re.search(rf'data-key-id="{key_id}".*?</tr>', users_page, re.S)
        assert row and 'value="5000"' in row.group(0)  # the quota set from the shell, read at start
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http, \
                http.get(url + "/backends", headers={"Accept": "application/json"}) as r:
            assert r.status == 200  # the key printed once still works
    assert not any("first start" in ln for ln in second.lines)  # the same data dir: nothing printed again


async def test_llmgw_admin_create_user_then_that_user_signs_in(nats_server: EmbeddedNatsServer,
                                                                tmp_path: Path) -> None:
    data = tmp_path / "gw"
    made = _llmgw("admin", "create-user", "alice", "--role", "user", "--password-stdin", "--data-dir", str(data),
                  stdin=PASSWORD + "\n")
    assert made.returncode == 0 and "created user 'alice'" in made.stdout, made.stderr
    again = _llmgw("admin", "create-user", "alice", "--password-stdin", "--data-dir", str(data), stdin=PASSWORD + "\n")
    assert again.returncode == 2 and "exists already" in again.stderr
    short = _llmgw("admin", "create-user", "bob", "--password-stdin", "--data-dir", str(data), stdin="short\n")
    assert short.returncode == 2 and "at least 10 characters" in short.stderr
    with _gateway(nats_server.url, data) as (url, gw):
        assert not any("first start" in ln for ln in gw.lines)  # a user exists: no bootstrap admin
        async with _jar() as http:
            assert await _signed_in(http, url, "alice", PASSWORD) == (303, "/account")
            async with http.get(url + "/account") as r:
                assert r.status == 200 and "alice (user)" in await r.text()
        async with _jar() as http:
            assert (await _signed_in(http, url, "alice", "not-her-password"))[0] == 401
        # made while the gateway runs (SQLite, shared with it): signs in at once, as an admin
        made = _llmgw("admin", "create-user", "carol", "--role", "admin", "--password-stdin", "--data-dir",
                      str(data), stdin=PASSWORD + "\n")
        assert made.returncode == 0, made.stderr
        async with _jar() as http:
            assert await _signed_in(http, url, "carol", PASSWORD) == (303, "/backends")


@needs_chromium
async def test_an_admin_sets_a_users_requests_per_minute_on_the_limits_page_and_it_binds_at_once(site: Site) -> None:
    store = site.gateway.auth.store
    dora = store.create_user("dora", hash_password(PASSWORD), "user")
    dora_key, dora_record = store.create_key(dora.user_id, "dora-notebook", None, time.time())
    page = site.page
    await _sign_in(site)
    await page.click("nav >> text=Limits")  # type: ignore[attr-defined]
    await page.wait_for_url("**/admin/limits")  # type: ignore[attr-defined]
    row = page.locator(f"#user-{dora.user_id}")  # type: ignore[attr-defined]
    await row.locator("input[name=requests_per_minute]").fill("2")
    await row.locator("button", has_text="Save").click()
    await page.wait_for_selector("text=Limits of user dora saved")  # type: ignore[attr-defined]
    row = page.locator(f"#user-{dora.user_id}")  # type: ignore[attr-defined]
    assert await row.locator("input[name=requests_per_minute]").input_value() == "2"
    assert (await row.locator("[data-spend=requests_per_minute]").text_content()).strip() == \
        "0 / 2 requests this minute"

    # it binds dora's next requests: two in this minute, then 429 (far enough from the minute's end that
    # the three requests and the page below see one window)
    if (left_s := 60.0 - time.time() % 60.0) < 15.0:
        await asyncio.sleep(left_s + 0.5)
    client = openai.AsyncOpenAI(base_url=site.url + "/v1", api_key=dora_key, max_retries=0)
    for _ in range(2):
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert refused.value.code == "rate_limit_exceeded"
    assert refused.value.response.headers["x-ratelimit-limit-requests"] == "2"
    assert refused.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(refused.value.response.headers["Retry-After"]) >= 1
    await page.goto(site.url + "/admin/limits")  # type: ignore[attr-defined]
    user_spend = page.locator(f"#user-{dora.user_id} [data-spend=requests_per_minute]")  # type: ignore[attr-defined]
    assert (await user_spend.text_content()).strip() == "2 / 2 requests this minute"  # the refused one not counted
    key_spend = page.locator(f"#key-{dora_record.key_id} [data-spend=requests_per_minute]")  # type: ignore[attr-defined]
    assert (await key_spend.text_content()).strip() == "2 requests this minute, no limit"
    await _shot(page, "admin-limits", to_docs=False)

    # a bad value: 400, the field marked with the reason, what was typed kept, the stored limit unchanged
    row = page.locator(f"#user-{dora.user_id}")  # type: ignore[attr-defined]
    await row.locator("input[name=requests_per_minute]").fill("-3")
    async with page.expect_response(lambda r: r.request.method == "POST") as posted:  # type: ignore[attr-defined]
        await row.locator("button", has_text="Save").click()
    assert (await posted.value).status == 400
    field = page.locator(f"#user-{dora.user_id} input[name=requests_per_minute]")  # type: ignore[attr-defined]
    assert await field.get_attribute("aria-invalid") == "true"
    assert await field.input_value() == "-3"
    error = page.locator(f"#err-user-{dora.user_id}-requests_per_minute")  # type: ignore[attr-defined]
    assert "must be a positive number" in await error.text_content()
    assert await page.locator("[role=alert]", has_text="Limits not saved").count() == 1  # type: ignore[attr-defined]
    assert store.limits_of(f"user-{dora.user_id}").requests_per_minute == 2

    # not for users: dora's session and dora's key get 403; no credentials at all, 401
    async with _jar() as http:
        assert (await _signed_in(http, site.url, "dora", PASSWORD))[0] == 303
        async with http.get(site.url + "/admin/limits") as r:
            assert r.status == 403
        async with http.get(site.url + "/account") as r:  # but dora sees what binds her, on her own page
            own = await r.text()
        assert r.status == 200 and 'id="own-limits"' in own
        assert "you (every key)" in own and "2 / 2 requests this minute" in own
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {dora_key}"}) as http:
        async with http.get(site.url + "/admin/limits.json") as r:
            assert r.status == 403
        async with http.put(site.url + "/admin/limits.json", json={"user": "dora", "requests_per_minute": None}) as r:
            assert r.status == 403
    async with aiohttp.ClientSession() as http, http.get(site.url + "/admin/limits.json") as r:
        assert r.status == 401
    assert store.limits_of(f"user-{dora.user_id}").requests_per_minute == 2

    # the JSON route round-trips, with the admin's key: null clears, absent keeps
    admin = {"Authorization": f"Bearer {site.gateway.bootstrap[1]}"}  # type: ignore[index]
    async with aiohttp.ClientSession(headers=admin) as http:
        async with http.put(site.url + "/admin/limits.json",
                            json={"user": "dora", "requests_per_minute": None, "usd_per_month": 3.5}) as r:
            assert r.status == 200
            assert (await r.json())["limits"] == {"tokens_per_day": None, "requests_per_minute": None,
                                                  "tokens_per_minute": None, "usd_per_month": 3.5,
                                                  "kwh_per_month": None}
        async with http.put(site.url + "/admin/limits.json",
                            json={"key_id": dora_record.key_id, "tokens_per_day": 9000, "tokens_per_minute": 500}) as r:
            assert r.status == 200
        async with http.get(site.url + "/admin/limits.json") as r:
            listed = await r.json()
        async with http.put(site.url + "/admin/limits.json", json={"user": "dora", "tokens_per_minute": 1.5}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "tokens_per_minute"
        async with http.put(site.url + "/admin/limits.json", json={"user": "nobody", "tokens_per_minute": 5}) as r:
            assert r.status == 404
    user_entry = next(u for u in listed["users"] if u["name"] == "dora")
    assert user_entry["limits"]["usd_per_month"] == 3.5 and user_entry["limits"]["requests_per_minute"] is None
    assert user_entry["spend"]["requests_per_minute"] == 2
    key_entry = next(k for k in listed["keys"] if k["key_id"] == dora_record.key_id)
    assert (key_entry["user"], key_entry["lineage"]) == ("dora", dora_record.key_id)
    assert (key_entry["limits"]["tokens_per_day"], key_entry["limits"]["tokens_per_minute"]) == (9000, 500)
    assert store.key_by_id(dora_record.key_id).daily_quota == 9000  # type: ignore[union-attr]  # the key's quota
    assert "energy_as_of_s" in listed
