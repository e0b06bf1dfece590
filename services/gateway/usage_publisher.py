"""The usage pipeline: every request's UsageRecord to the ``USAGE`` stream, exactly once.

Records wait in a bounded memory queue and go out a batch at a time, each acked by JetStream on its
own (``Nats-Msg-Id`` lets the stream drop a resend); what the bus did not take — or what found the queue
full — goes to the disk spool (:mod:`services.gateway.usage_spool`) and is resent from there. Answers
still being accounted after their handler ended (an abort report, an abandoned read) are held in
:meth:`UsagePublisher.settle_later` so a shutdown waits for their records before the queue is flushed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client

from proto import UsageRecord, decode, encode, subjects
from services.common.runtime import ThrottledLog, raise_if_cancelling
from services.gateway.acked_publisher import AckedPublisher
from services.gateway.usage_spool import UsageSpool

log = logging.getLogger(__name__)
USAGE_BATCH = 256  # usage records sent before waiting for their acks


class UsagePublisher:
    """The queue, the spool and the publisher of one gateway's usage records (``usage_buffer`` in memory)."""

    def __init__(self, nc: Client, gateway_id: str, spool: UsageSpool, usage_buffer: int,
                 quiet_log: ThrottledLog) -> None:
        self.nc = nc
        self.gateway_id = gateway_id
        self.spool = spool
        self._quiet_log = quiet_log
        self._usage_queue: asyncio.Queue[UsageRecord] = asyncio.Queue(maxsize=usage_buffer)
        self._acked = AckedPublisher(nc)
        self.usage_published = 0
        self._settling: set[asyncio.Future[Any]] = set()  # answers still being accounted (see :meth:`settle_later`)

    async def start(self) -> None:
        await self._acked.start()

    async def stop(self) -> None:
        await self._acked.stop()

    def submit(self, record: UsageRecord) -> None:
        """Queue one record; a full queue spools it to disk (and only a full spool loses it, said in the log)."""
        try:
            self._usage_queue.put_nowait(record)
        except asyncio.QueueFull:
            if not self.spool.append(encode(record)):
                log.error("usage of %s could not be kept (memory queue and spool full)", record.request_id)

    def settle_later(self, settling: asyncio.Future[Any], settle: Callable[[], None]) -> None:
        """Call ``settle`` (which writes the record) when ``settling`` is done; a shutdown waits for it."""
        self._settling.add(settling)

        def done(f: asyncio.Future[Any]) -> None:
            self._settling.discard(f)
            settle()

        settling.add_done_callback(done)

    def _usage_message(self, data: bytes, request_id: str) -> tuple[str, bytes, dict[str, str]]:
        # Nats-Msg-Id lets the stream drop a duplicate when we resend after a lost ack.
        return subjects.usage(self.gateway_id), data, {"Nats-Msg-Id": f"usage-{request_id}"}

    async def publish_usage(self) -> None:
        """Send records as they come, a batch of what is queued at a time (each acked on its own); what
        the stream did not take within 2 s goes to the disk spool and is resent from there."""
        while True:
            raise_if_cancelling()
            batch = [await self._usage_queue.get()]
            while len(batch) < USAGE_BATCH and not self._usage_queue.empty():
                batch.append(self._usage_queue.get_nowait())
            data = [encode(record) for record in batch]
            stored: list[bool] = []
            try:
                stored = await self._acked.publish(
                    [self._usage_message(d, r.request_id) for d, r in zip(data, batch, strict=True)], timeout_s=2.0)
            finally:  # also when cancelled: what was not acked is kept on disk
                for i, (d, record) in enumerate(zip(data, batch, strict=True)):
                    if i < len(stored) and stored[i]:
                        self.usage_published += 1
                    else:
                        self._quiet_log.warning("spooled", "usage of %s spooled to disk (the bus did not take it)",
                                                record.request_id)
                        self.spool.append(d)
                    self._usage_queue.task_done()

    async def resend_spooled(self) -> None:
        while True:
            raise_if_cancelling()
            await asyncio.sleep(1.0)
            if not self.spool.has_pending() or not self.nc.is_connected:
                continue
            try:
                pending = self.spool.take()
                for start in range(0, len(pending), USAGE_BATCH):
                    chunk = pending[start:start + USAGE_BATCH]
                    stored = await self._acked.publish(
                        [self._usage_message(d, decode(d, UsageRecord).request_id) for d in chunk], timeout_s=5.0)
                    self.usage_published += sum(stored)
                    if not all(stored):
                        raise RuntimeError(f"the bus took {sum(stored)} of {len(chunk)} records")
                self.spool.done()
                log.info("spooled usage records delivered")
            except Exception as exc:
                raise_if_cancelling()
                log.warning("spooled usage not delivered yet: %s", exc)

    async def wait_settling(self, timeout_s: float) -> None:
        """Let answers still being accounted write their records before the usage queue is flushed."""
        if self._settling:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait(list(self._settling), timeout=timeout_s)

    async def flush_usage(self, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await self._usage_queue.join()
        except TimeoutError:
            raise_if_cancelling()
