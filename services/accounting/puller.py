"""A batch fetcher for a durable JetStream pull consumer, built on one callback subscription.

Why not ``PullSubscription.fetch``: nats-py hands each message over with its own ``next_msg`` wait
(a task and a timer per message); measured here, a 1024-message fetch took 25-90 ms, which alone caps
ingest below the 20,000 records/s target (docs/benchmarks.md, "Accounting ingest"). Messages arriving
on one inbox through a subscription callback cost a small fraction of that.

Protocol (JetStream pull API): a request on ``$JS.API.CONSUMER.MSG.NEXT.<stream>.<durable>`` with the
inbox as reply subject. ``no_wait`` returns what is available now, ending with a 404 status when fewer
than ``batch`` were; with ``expires`` (and ``batch`` 1) the server holds the request until a message
arrives or it expires (408). Status messages carry no payload and a ``Status`` header.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig
from nats.js.errors import NotFoundError

from services.common.runtime import raise_if_cancelling


class BatchPuller:
    """``fetch(batch, timeout_s)`` → up to ``batch`` messages; an empty list after ``timeout_s`` of quiet."""

    def __init__(self, nc: Client, stream: str, durable: str, subject: str, config: ConsumerConfig) -> None:
        self.nc = nc
        self.stream = stream
        self.durable = durable
        self.subject = subject
        self.config = config
        self._inbox = nc.new_inbox()
        self._buffer: list[Msg] = []
        self._want = 1
        self._wake = asyncio.Event()  # enough messages buffered, or a status ended a request
        self._sub: Any = None

    async def start(self) -> None:
        """Create (or bind to) the durable consumer and subscribe the inbox."""
        js = self.nc.jetstream()
        try:
            await js.consumer_info(self.stream, self.durable)
        except NotFoundError:
            await js.add_consumer(self.stream, self.config)
        self._sub = await self.nc.subscribe(self._inbox, cb=self._on_msg)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def _on_msg(self, msg: Msg) -> None:
        if msg.headers and "Status" in msg.headers and not msg.data:
            self._wake.set()
            return
        self._buffer.append(msg)
        if len(self._buffer) >= self._want:
            self._wake.set()

    async def _request(self, **body: Any) -> None:
        await self.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.durable}",
                              json.dumps(body).encode(), reply=self._inbox)

    async def _wait(self, want: int, timeout_s: float) -> None:
        """Until ``want`` messages are buffered, a status arrives, or ``timeout_s`` passes. Waking once per
        batch (not per message) is the point of this class."""
        self._want = want
        self._wake.clear()
        if len(self._buffer) >= want:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._wake.wait()
        raise_if_cancelling()

    async def fetch(self, batch: int, timeout_s: float) -> list[Msg]:
        if not self._buffer:
            # Nothing buffered: the server holds the request until a first message arrives or it expires.
            await self._request(batch=1, expires=int(timeout_s * 1e9))
            await self._wait(1, timeout_s + 0.5)
            if not self._buffer:
                return []
        if len(self._buffer) < batch:
            # Some are here: take what else is available now, without waiting (404 ends a short batch).
            await self._request(batch=batch - len(self._buffer), no_wait=True)
            await self._wait(batch, timeout_s)
        out, self._buffer = self._buffer[:batch], self._buffer[batch:]
        return out
