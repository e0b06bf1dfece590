"""GenerateRequest.deadline_s through the real bus: the engine's worker drops what the gateway gave up on."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.subscription import Subscription

from proto import Cancel, GenerateRequest, TokenChunk, decode, encode, subjects
from services.common.bus import connect, ensure_bus
from services.common.nats_server import EmbeddedNatsServer
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.serve.async_engine import AsyncEngine
from services.engine.serve.worker import BusWorker, WorkerConfig
from tests.conftest import LONG_GENERATION_TOKENS
from tests.integration.conftest import wait_for


@pytest.fixture
async def one_lane(nats_server: EmbeddedNatsServer, long_model: Path) -> AsyncIterator[tuple[Client, AsyncEngine]]:
    """An engine with one lane behind its bus worker "w1", and a client connection."""
    async with contextlib.AsyncExitStack() as es:
        engine_nc, client = await connect(nats_server.url, "engine"), await connect(nats_server.url, "client")
        es.push_async_callback(client.drain)
        es.push_async_callback(engine_nc.drain)
        await ensure_bus(engine_nc)
        core = EngineCore(EngineConfig(model_path=long_model, model_id="tiny", max_concurrency=1,
                                       max_pending_requests=4, kv_capacity_tokens=LONG_GENERATION_TOKENS + 64,
                                       torch_threads=1))
        engine = await es.enter_async_context(AsyncEngine(core))
        worker = BusWorker(engine_nc, engine, WorkerConfig(worker_id="w1", heartbeat_interval_s=0.2))
        heartbeats = await client.subscribe(subjects.heartbeat("w1"))
        async with asyncio_task(worker.run()):
            await heartbeats.next_msg(timeout=10)  # the worker has subscribed to its subjects
            await heartbeats.unsubscribe()
            yield client, engine


@contextlib.asynccontextmanager
async def asyncio_task(coro: Coroutine[Any, Any, None]) -> AsyncIterator[asyncio.Task[None]]:
    """Run ``coro`` as a task for the block; cancelled and awaited on exit."""
    task = asyncio.create_task(coro)
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def send(client: Client, req: GenerateRequest) -> Subscription:
    inbox = client.new_inbox()
    sub = await client.subscribe(inbox)
    await client.publish(subjects.gen("w1"), encode(req), reply=inbox)
    return sub


async def next_chunk(sub: Subscription) -> TokenChunk:
    return decode((await sub.next_msg(timeout=10)).data, TokenChunk)


async def test_a_request_past_its_deadline_is_refused_before_admission(one_lane: tuple[Client, AsyncEngine]) -> None:
    client, engine = one_lane
    sub = await send(client, GenerateRequest(request_id="late", model="tiny", prompt="hello", max_tokens=4,
                                             deadline_s=time.time() - 1.0))
    chunk = await next_chunk(sub)
    assert chunk.index == 0 and chunk.finish_reason == "error" and chunk.worker_id == "w1"
    assert chunk.error is not None and chunk.error.code == "deadline_exceeded" and chunk.error.status == 504
    assert engine.num_deadline_dropped == 1
    assert engine.snapshot().admitted_total == 0  # never reached the engine core


async def test_a_request_whose_deadline_passes_in_the_queue_is_aborted(one_lane: tuple[Client, AsyncEngine]) -> None:
    client, engine = one_lane
    busy = await send(client, GenerateRequest(request_id="busy", model="tiny", prompt="hello",
                                              max_tokens=LONG_GENERATION_TOKENS, temperature=0.0, ignore_eos=True))
    assert (await next_chunk(busy)).error is None  # accepted
    assert (await next_chunk(busy)).token_ids  # producing: it holds the only lane
    queued = await send(client, GenerateRequest(request_id="queued", model="tiny", prompt="hello", max_tokens=4,
                                                deadline_s=time.time() + 0.5))
    accepted = await next_chunk(queued)
    assert accepted.index == 0 and accepted.error is None
    await wait_for(lambda: engine.snapshot().stats.num_waiting == 1)
    dropped = await next_chunk(queued)
    assert dropped.index == 1 and dropped.finish_reason == "error"
    assert dropped.error is not None and dropped.error.code == "deadline_exceeded" and dropped.error.status == 504
    assert engine.num_deadline_dropped == 1
    await wait_for(lambda: engine.snapshot().stats.num_waiting == 0)  # its place in the queue is freed
    assert engine.snapshot().stats.num_running == 1  # the busy request goes on
    await client.publish(subjects.cancel("w1"), encode(Cancel(request_id="busy")))


@pytest.mark.parametrize("payload", [encode(Cancel(request_id="busy")), b"busy"], ids=["typed", "raw-id"])
async def test_a_cancel_typed_or_from_an_older_gateway_ends_the_request(one_lane: tuple[Client, AsyncEngine],
                                                                         payload: bytes) -> None:
    client, engine = one_lane
    busy = await send(client, GenerateRequest(request_id="busy", model="tiny", prompt="hello",
                                              max_tokens=LONG_GENERATION_TOKENS, temperature=0.0, ignore_eos=True))
    assert (await next_chunk(busy)).error is None  # accepted
    assert (await next_chunk(busy)).token_ids  # producing
    await client.publish(subjects.cancel("w1"), payload)
    await client.publish(subjects.cancel("w1"), b"\xc1 not a request id")  # garbage is ignored, not a crash
    await wait_for(lambda: engine.snapshot().stats.num_running == 0)
