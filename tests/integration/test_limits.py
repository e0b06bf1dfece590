"""Issue #21 (2, 3): limits bind the principal (docs/admin.md, "Limits"; services/gateway/limits.py).

Real nats-server, our engine (tiny checkpoint) behind its bus worker, the accounting service, two gateway
replicas serving HTTP on loopback, and the official ``openai`` client. A "fake meter" publishes energy
samples in the engine's own format (NVML cumulative millijoules) for the kWh budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from proto import EnergyReading, EnergySample, RequestTokens, encode, subjects
from services.accounting.service import AccountingService
from services.common.bus import connect
from services.common.http import serving
from services.common.nats_server import EmbeddedNatsServer
from services.gateway import peers as gateway_peers
from services.gateway import pools
from services.gateway.identity import hash_password
from services.gateway.limits import Limits, key_principal, user_principal
from services.gateway.service import GatewayConfig, GatewayService
from tests.integration.conftest import start_engine_and_ledger, wait_for

PROMPT = "count to five"


@dataclass
class Replicas:
    urls: list[str]
    gateways: list[GatewayService]
    accounting: AccountingService
    nc: object

    def sdk(self, key: str, replica: int = 0) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.urls[replica] + "/v1", api_key=key, max_retries=0, timeout=60)

    async def rows(self, n: int) -> list[dict]:  # type: ignore[type-arg]
        sql = ("SELECT request_id, status, http_status, prompt_tokens, output_tokens, limit_kind, api_key_id, "
               "user_id, error_code FROM requests ORDER BY ts")
        async with asyncio.timeout(30):
            while len((await self.accounting.run_sql(sql))[1]) < n:
                await asyncio.sleep(0.1)
        columns, rows = await self.accounting.run_sql(sql)
        assert len(rows) == n
        return [dict(zip(columns, r, strict=True)) for r in rows]


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextlib.asynccontextmanager
async def replicas(nats_server: EmbeddedNatsServer, model: Path, tmp_path: Path, n: int = 2,
                   key_energy_poll_s: float = 5.0) -> AsyncIterator[Replicas]:
    async with contextlib.AsyncExitStack() as es:
        # replicas of one fleet share the secret their identity rows are signed with (docs/deploy.md)
        es.enter_context(_env("LLMGW_FLEET_SECRET", "limits-test-fleet-secret"))
        parts = await start_engine_and_ledger(es, nats_server.url, model, tmp_path, kv_capacity_tokens=8192,
                                              max_concurrency=8, max_pending_requests=64)
        accounting = parts.accounting
        test_nc = await connect(nats_server.url, "test")
        es.push_async_callback(test_nc.drain)
        gw_ncs = []
        for i in range(n):
            gw_ncs.append(await connect(nats_server.url, f"gw{i}"))
            es.push_async_callback(gw_ncs[-1].drain)
        gateways, urls = [], []
        for i, gw_nc in enumerate(gw_ncs):
            g = GatewayService(gw_nc, GatewayConfig(gateway_id=f"gw{i}", port=0, data_dir=tmp_path / f"gw{i}",
                                                    key_energy_poll_s=key_energy_poll_s))
            await es.enter_async_context(g.running())
            urls.append(await es.enter_async_context(serving(g.app(), "127.0.0.1", 0)))
            gateways.append(g)
        for g in gateways:
            await wait_for(lambda g=g: "tiny" in pools.model_names(g.pools_file.file_config, g.fleet))
        yield Replicas(urls, gateways, accounting, test_nc)


async def chat(api: openai.AsyncOpenAI, max_tokens: int = 8, ignore_eos: bool = False
               ) -> openai.types.chat.ChatCompletion | openai.APIStatusError:
    try:
        return await api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=max_tokens, extra_body={"ignore_eos": ignore_eos})
    except openai.APIStatusError as exc:
        return exc


@pytest.fixture(autouse=True)
def quick_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway_peers, "QUOTA_SHARE_S", 0.05)


async def test_a_users_daily_tokens_bind_every_key_it_makes_and_32_parallel_requests_overshoot_by_one_reservation(
        nats_server, long_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    async with replicas(nats_server, long_model, tmp_path, n=1) as r:
        gw = r.gateways[0]
        user = gw.identity.create_user("dave", hash_password("dave-password-1"), "user")
        limit = 200
        gw.identity.set_limits(user_principal(user.user_id), Limits(tokens_per_day=limit))
        key, _ = gw.identity.create_key(user.user_id, "first", None, time.time())
        api = r.sdk(key)
        # one request first: the gateway learns how many tokens this model makes of the prompt's characters
        # (the tiny checkpoint's small vocabulary and the chat template make far more than characters / 4)
        warm = await chat(r.sdk(r.gateways[0].bootstrap[1]), max_tokens=1)  # type: ignore[index]
        assert not isinstance(warm, openai.APIStatusError) and warm.usage is not None
        reservation = warm.usage.prompt_tokens + 20  # the prompt as learnt + max_tokens
        # every request uses all it reserved (no early EOS from the random weights), so the burst spends the
        # whole limit and the new key below finds no room
        results = await asyncio.gather(*(chat(api, max_tokens=20, ignore_eos=True) for _ in range(32)))
        ok = [x for x in results if not isinstance(x, openai.APIStatusError)]
        refused = [x for x in results if isinstance(x, openai.APIStatusError)]
        assert ok and refused
        assert all(x.status_code == 429 and x.code == "quota_exceeded" for x in refused)
        assert all(int(x.response.headers["retry-after"]) >= 1 for x in refused)
        used = sum(x.usage.total_tokens for x in ok)  # type: ignore[union-attr]
        # admitted while settled + reserved < 200: at most one reservation beyond the limit, however many
        # were in flight together
        assert used <= limit + reservation, (used, len(ok))
        # a new key of the same user (no limit of its own) is refused too: the user's spend binds it
        second, _ = gw.identity.create_key(user.user_id, "second", None, time.time())
        again = await chat(r.sdk(second))
        assert isinstance(again, openai.APIStatusError) and again.status_code == 429
        assert "your user" in again.message
        rows = [row for row in await r.rows(34) if row["user_id"] == user.user_id]
        assert len(rows) == 33
        assert {row["limit_kind"] for row in rows if row["http_status"] == 429} == {"tokens_per_day"}
        assert sum(row["prompt_tokens"] + row["output_tokens"] for row in rows) == used


async def test_a_rotated_key_carries_its_counters_and_a_key_limit_binds_under_a_roomy_user(
        nats_server, long_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    async with replicas(nats_server, long_model, tmp_path, n=1) as r:
        gw = r.gateways[0]
        user = gw.identity.create_user("erin", hash_password("erin-password-1"), "user")
        gw.identity.set_limits(user_principal(user.user_id), Limits(tokens_per_day=1_000_000))
        # the key's own 10 tokens a day: its first request (a chat-templated prompt of 13 characters is more
        # than 10 tokens alone) is admitted with room left and spends them all
        key, record = gw.identity.create_key(user.user_id, "ci", 10, time.time())
        first = await chat(r.sdk(key), max_tokens=4)
        assert not isinstance(first, openai.APIStatusError)
        new_key, new_record = gw.identity.rotate_key(record.key_id, 0.0, time.time())
        assert new_record.lineage == record.key_id
        refused = await chat(r.sdk(new_key))
        assert isinstance(refused, openai.APIStatusError) and refused.status_code == 429
        assert refused.code == "quota_exceeded" and "this API key" in refused.message
        assert gw.auth.used_today(new_record.key_id, time.time()) == first.usage.total_tokens > 10  # type: ignore[union-attr]
        # another key of the same user is not bound by the first key's limit
        other, _ = gw.identity.create_key(user.user_id, "other", None, time.time())
        assert not isinstance(await chat(r.sdk(other)), openai.APIStatusError)


async def test_requests_per_minute_carry_openais_rate_limit_headers_and_hold_across_two_gateways(
        nats_server, long_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    async with replicas(nats_server, long_model, tmp_path, n=2) as r:
        gw0, gw1 = r.gateways
        user = gw0.identity.create_user("fay", hash_password("fay-password-1"), "user")
        key, record = gw0.identity.create_key(user.user_id, "k", None, time.time())
        gw0.identity.set_limits(key_principal(record.key_id), Limits(requests_per_minute=4, tokens_per_minute=10_000))
        await wait_for(lambda: gw1.identity.limits_of(key_principal(record.key_id)).requests_per_minute == 4, 5)
        await wait_for(lambda: gw1.identity.lookup_key(record.key_sha256, time.time()) is not None, 5)
        if time.time() % 60 > 50:  # the four requests must fall in one minute window
            await asyncio.sleep(61 - time.time() % 60)
        raw = await r.sdk(key, 0).chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=4)
        completion = raw.parse()
        h = raw.headers
        assert h["x-ratelimit-limit-requests"] == "4" and h["x-ratelimit-remaining-requests"] == "3"
        assert h["x-ratelimit-limit-tokens"] == "10000"
        # admission counted the reservation: the prompt estimate (no history yet: ceil(13 characters / 4) = 4)
        # + max_tokens 4; OpenAI's "remaining" is what is left after this request
        assert h["x-ratelimit-remaining-tokens"] == str(10_000 - (4 + 4))
        assert h["x-ratelimit-reset-requests"].endswith("s") and completion.usage is not None
        await chat(r.sdk(key, 0))
        # the other replica sees both once they are shared (every QUOTA_SHARE_S)
        counter = f"{key_principal(record.key_id)}|requests_per_minute|m{int(time.time() // 60)}"
        await wait_for(lambda: gw1.auth.book.counted(counter) == 2, 5)
        assert not isinstance(await chat(r.sdk(key, 1)), openai.APIStatusError)
        assert not isinstance(await chat(r.sdk(key, 1)), openai.APIStatusError)
        await wait_for(lambda: gw0.auth.book.counted(counter) == 4, 5)
        refused = await chat(r.sdk(key, 0))
        assert isinstance(refused, openai.APIStatusError) and refused.status_code == 429
        assert refused.code == "rate_limit_exceeded"
        assert refused.response.headers["x-ratelimit-remaining-requests"] == "0"
        assert 1 <= int(refused.response.headers["retry-after"]) <= 60
        rows = await r.rows(5)
        assert [row["limit_kind"] for row in rows] == [None, None, None, None, "requests_per_minute"]


async def test_a_kwh_budget_refuses_once_the_ledgers_attributed_energy_of_the_month_passes_it(
        nats_server, long_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    async with replicas(nats_server, long_model, tmp_path, n=1, key_energy_poll_s=0.1) as r:
        gw = r.gateways[0]
        user = gw.identity.create_user("gus", hash_password("gus-password-1"), "user")
        budget_kwh = 0.001  # 3,600 J
        gw.identity.set_limits(user_principal(user.user_id), Limits(kwh_per_month=budget_kwh))
        key, _ = gw.identity.create_key(user.user_id, "k", None, time.time())
        raw = await r.sdk(key).chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=8)
        request_id = raw.headers["x-request-id"]
        completion = raw.parse()
        assert completion.usage is not None
        # the fake meter: a GPU whose cumulative counter rose 5,000,000 mJ (5,000 J) over a 2 s interval in
        # which only this request produced tokens; the ledger attributes all 5,000 J to it
        now = time.time()
        for seq, (ts, mj, tokens) in enumerate([(now - 2, 10_000_000, []),
                                                (now, 15_000_000, [RequestTokens(
                                                    request_id=request_id, prompt_tokens=0,
                                                    output_tokens=completion.usage.completion_tokens)])]):
            sample = EnergySample(worker_id="meter1", session_id="s1", seq=seq, ts_s=ts, model_id="tiny",
                                  readings=[EnergyReading(device_id="GPU-fake-0", kind="nvml", method="counter",
                                                          energy_mj=mj)], request_tokens=tokens)
            await r.nc.jetstream().publish(subjects.energy("meter1"), encode(sample))  # type: ignore[attr-defined]
        principal = user_principal(user.user_id)
        await wait_for(lambda: (gw.auth.book.energy_kwh.get(principal) or 0) > 0, 20)
        assert gw.auth.book.energy_kwh[principal] == pytest.approx(5000 / 3.6e6)  # 0.00139 kWh > 0.001
        refused = await chat(r.sdk(key))
        assert isinstance(refused, openai.APIStatusError) and refused.status_code == 429
        assert refused.code == "energy_budget_exceeded"
        rows = await r.rows(2)
        assert rows[-1]["limit_kind"] == "kwh_per_month"
