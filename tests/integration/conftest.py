"""In-process services on a real nats-server: engine worker, accounting, gateway on port 0."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.accounting.service import AccountingConfig, AccountingService
from services.common.bus import connect, ensure_bus
from services.common.http import serving
from services.common.nats_server import EmbeddedNatsServer
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.serve.async_engine import AsyncEngine
from services.engine.serve.worker import BusWorker, WorkerConfig
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


@dataclass
class EngineAndLedger:
    """Our engine (in process, behind its real bus worker) and the accounting service, both running."""

    engine: AsyncEngine
    worker: BusWorker
    accounting: AccountingService


async def start_engine_and_ledger(es: contextlib.AsyncExitStack, nats_url: str, model: Path, tmp_path: Path,
                                  **engine: int) -> EngineAndLedger:
    """Start them under ``es`` (stopped when it closes); ``engine`` overrides the EngineConfig sizes."""
    engine_nc, acct_nc = await connect(nats_url, "engine"), await connect(nats_url, "accounting")
    es.push_async_callback(acct_nc.drain)
    es.push_async_callback(engine_nc.drain)
    await ensure_bus(acct_nc)
    sizes = {"kv_capacity_tokens": 2048, "max_concurrency": 4, "max_pending_requests": 8} | engine
    core = EngineCore(EngineConfig(model_path=model, model_id="tiny", **sizes))  # type: ignore[arg-type]
    handle = await es.enter_async_context(AsyncEngine(core))
    worker = BusWorker(engine_nc, handle, WorkerConfig(worker_id="w1", heartbeat_interval_s=0.2))
    accounting = AccountingService(acct_nc, AccountingConfig(db_path=tmp_path / "ledger.duckdb",
                                                             fetch_timeout_s=0.2))
    tasks = [asyncio.create_task(worker.run()), asyncio.create_task(accounting.run())]

    async def stop_tasks() -> None:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    es.push_async_callback(stop_tasks)
    return EngineAndLedger(handle, worker, accounting)


@pytest.fixture
async def stack(nats_server: EmbeddedNatsServer, tiny_model: Path, tmp_path: Path) -> AsyncIterator[Stack]:
    async with contextlib.AsyncExitStack() as es:
        parts = await start_engine_and_ledger(es, nats_server.url, tiny_model, tmp_path)
        gw_nc = await connect(nats_server.url, "gateway")
        es.push_async_callback(gw_nc.drain)
        gateway = GatewayService(gw_nc, GatewayConfig(gateway_id="gw1", port=0, data_dir=tmp_path))
        await es.enter_async_context(gateway.running())
        base_url = await es.enter_async_context(serving(gateway.app(), "127.0.0.1", 0))
        await wait_for(lambda: "tiny" in pools.model_names(gateway.pools_file.file_config, gateway.fleet))
        assert gateway.bootstrap is not None
        accounting, worker = parts.accounting, parts.worker
        yield Stack(base_url, gateway, accounting, worker, nats_server.url, gateway.bootstrap[1])
