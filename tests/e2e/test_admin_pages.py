"""The admin pages in a real headless Chromium (Debian's /usr/bin/chromium driven by Playwright).

One in-process stack (real nats-server, two tiny engine workers, accounting, the gateway on loopback);
each test walks a page as an operator would and saves a screenshot to ``test-artifacts/`` (set
LLMGW_SCREENSHOTS_TO_DOCS=1 to refresh the copies in docs/img/).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from services.accounting.service import AccountingConfig, AccountingService
from services.common import pool_config
from services.common.bus import connect, ensure_bus
from services.common.http import serving
from services.common.nats_server import EmbeddedNatsServer
from services.engine.async_engine import AsyncEngine
from services.engine.engine_core import EngineConfig, EngineCore
from services.engine.worker import BusWorker, WorkerConfig
from services.gateway.service import GatewayConfig, GatewayService
from tests.e2e.procs import REPO
from tests.integration.conftest import wait_for

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("LLMGW_TEST_ARTIFACTS", REPO / "test-artifacts"))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]

# Under CI (.ci/run sets LLMGW_CI=1 and installs chromium) a missing browser fails instead of skipping.
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists() and os.environ.get("LLMGW_CI") != "1",
                                reason="needs Debian's chromium (scripts/install-test-tools.sh installs it)")


@dataclass
class Site:
    url: str
    gateway: GatewayService
    accounting: AccountingService
    password: str
    page: object  # playwright Page


async def _shot(page, name: str) -> None:  # type: ignore[no-untyped-def]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    await page.screenshot(path=str(path), full_page=True)
    if os.environ.get("LLMGW_SCREENSHOTS_TO_DOCS") == "1":
        shutil.copy(path, REPO / "docs" / "img" / f"{name}.png")


@pytest.fixture
async def site(nats_server: EmbeddedNatsServer, tiny_model: Path, tmp_path: Path) -> AsyncIterator[Site]:
    from playwright.async_api import async_playwright

    async with contextlib.AsyncExitStack() as es:
        tasks: list[asyncio.Task[None]] = []
        ncs = []
        for name in ("w1", "w2", "accounting", "gateway"):
            c = await connect(nats_server.url, name)
            ncs.append(c)
            es.push_async_callback(c.drain)
        await ensure_bus(ncs[-1])
        for wid, nc in zip(("w1", "w2"), ncs, strict=False):
            core = EngineCore(EngineConfig(model_path=tiny_model, model_id="tiny", kv_capacity_tokens=4096,
                                           max_concurrency=2, max_pending_requests=8))
            engine = await es.enter_async_context(AsyncEngine(core))
            tasks.append(asyncio.create_task(BusWorker(nc, engine, WorkerConfig(worker_id=wid,
                                                                               heartbeat_interval_s=0.2)).run()))
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
        page = await browser.new_page(viewport={"width": 1200, "height": 800})
        assert gateway.bootstrap is not None
        yield Site(url, gateway, accounting, gateway.bootstrap[0], page)


async def _sign_in(site: Site) -> None:
    page = site.page
    await page.goto(site.url + "/")  # type: ignore[attr-defined]
    await _shot(page, "admin-signin")
    await page.fill("#name", "admin")  # type: ignore[attr-defined]
    await page.fill("#password", site.password)  # type: ignore[attr-defined]
    await page.click("button[type=submit]")  # type: ignore[attr-defined]
    await page.wait_for_url("**/backends")  # type: ignore[attr-defined]


async def test_sign_in_see_backends_then_create_a_key_and_use_it(site: Site) -> None:
    page = site.page
    await _sign_in(site)
    assert await page.locator("tr[data-member=w1]").count() == 1  # type: ignore[attr-defined]
    await page.wait_for_selector("tr[data-member=w2] .load svg.spark", timeout=10_000)  # type: ignore[attr-defined]
    await _shot(page, "admin-backends")
    await page.set_viewport_size({"width": 390, "height": 844})  # type: ignore[attr-defined]  # a phone
    assert await page.evaluate("document.documentElement.scrollWidth") <= 390 + 1  # type: ignore[attr-defined]
    await _shot(page, "admin-backends-phone")
    await page.set_viewport_size({"width": 1200, "height": 800})  # type: ignore[attr-defined]

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


async def test_costs_page_fills_after_traffic(site: Site) -> None:
    page = site.page
    client = openai.AsyncOpenAI(base_url=site.url + "/v1", api_key=site.gateway.bootstrap[1],  # type: ignore[index]
                                max_retries=0)
    for _ in range(3):
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                             max_tokens=4)
    await wait_for(lambda: site.accounting.stats.usage_ingested >= 3)
    await _sign_in(site)
    await page.goto(site.url + "/admin/costs")  # type: ignore[attr-defined]
    row = page.locator("#by-model tr", has_text="tiny")  # type: ignore[attr-defined]
    assert await row.count() == 1
    output_tokens = int((await row.locator("td.num").nth(2).text_content()).replace(",", ""))
    assert output_tokens > 0
    assert await page.locator("svg.chart").count() == 1  # type: ignore[attr-defined]
    await _shot(page, "admin-costs")
    await page.goto(site.url + "/admin/users")  # type: ignore[attr-defined]
    await _shot(page, "admin-users")
