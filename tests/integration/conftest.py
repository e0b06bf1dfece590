"""In-process services on a real nats-server: engine worker, accounting, gateway on port 0."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.accounting.service import AccountingConfig, AccountingService
from services.common.bus import connect
from services.common.http import serving
from services.common.nats_server import EmbeddedNatsServer
from services.engine.async_engine import AsyncEngine
from services.engine.engine_core import EngineConfig, EngineCore
from services.engine.worker import BusWorker, WorkerConfig
from services.gateway import pools
from services.gateway.service import GatewayConfig, GatewayService


@dataclass
class Stack:
    base_url: str
    gateway: GatewayService
    accounting: AccountingService
    worker: BusWorker
    nats_url: str
    api_key: str  # the bootstrap admin's key

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


async def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.02) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(interval_s)


@pytest.fixture
async def stack(nats_server: EmbeddedNatsServer, tiny_model: Path, tmp_path: Path) -> AsyncIterator[Stack]:
    async with contextlib.AsyncExitStack() as es:
        clients = []
        for name in ("engine", "accounting", "gateway"):
            c = await connect(nats_server.url, name)
            clients.append(c)
            es.push_async_callback(c.drain)
        engine_nc, acct_nc, gw_nc = clients
        from services.common.bus import ensure_bus

        await ensure_bus(gw_nc)
        core = EngineCore(EngineConfig(model_path=tiny_model, model_id="tiny", kv_capacity_tokens=2048,
                                       max_concurrency=4, max_pending_requests=8))
        engine = await es.enter_async_context(AsyncEngine(core))
        worker = BusWorker(engine_nc, engine, WorkerConfig(worker_id="w1", heartbeat_interval_s=0.2))
        accounting = AccountingService(acct_nc, AccountingConfig(db_path=tmp_path / "ledger.duckdb",
                                                                 fetch_timeout_s=0.2))
        gateway = GatewayService(gw_nc, GatewayConfig(gateway_id="gw1", port=0, data_dir=tmp_path))
        tasks = [asyncio.create_task(worker.run()), asyncio.create_task(accounting.run())]
        await es.enter_async_context(gateway.running())
        base_url = await es.enter_async_context(serving(gateway.app(), "127.0.0.1", 0))
        await wait_for(lambda: "tiny" in pools.model_names(gateway.file_config, gateway.fleet))

        async def stop_tasks() -> None:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        es.push_async_callback(stop_tasks)
        assert gateway.bootstrap is not None
        yield Stack(base_url, gateway, accounting, worker, nats_server.url, gateway.bootstrap[1])
