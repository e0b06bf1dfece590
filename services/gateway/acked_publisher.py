"""JetStream publishes sent in batches, each message still acknowledged on its own.

nats-py's ``JetStreamContext.publish`` is a request: a new inbox, a future and a timer per message, and
the next message waits for the last one's ack. The gateway publishes one usage record per request, so
at thousands of requests a second that round trip was a tenth of its CPU and capped how fast usage
could leave. Here a batch goes out back to back, each with its own reply subject under one standing
subscription, and the batch waits once for all of its acks (or the deadline).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import Sequence

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription


class AckedPublisher:
    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.prefix = f"_INBOX.{secrets.token_hex(11)}."  # ours alone: the acks come back on prefix.<token>
        self._waiting: dict[str, asyncio.Future[None]] = {}
        self._tokens = itertools.count()
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.prefix + "*", cb=self._on_ack)

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # the connection is gone already: nothing to undo
                pass
            self._sub = None

    async def publish(self, messages: Sequence[tuple[str, bytes, dict[str, str]]], timeout_s: float) -> list[bool]:
        """Send (subject, payload, headers) messages; True for each the stream stored within ``timeout_s``.

        A False may still have been stored (its ack was lost): resend it with the same ``Nats-Msg-Id``
        header and the stream drops the duplicate.
        """
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[None]] = []
        tokens: list[str] = []
        try:
            for subject, payload, headers in messages:
                token = str(next(self._tokens))
                future = loop.create_future()
                self._waiting[token] = future
                tokens.append(token)
                futures.append(future)
                await self.nc.publish(subject, payload, reply=self.prefix + token, headers=headers)
            if futures:
                await asyncio.wait(futures, timeout=timeout_s)
        except Exception:  # the connection refused the publish (closed, buffer full): not stored
            pass
        finally:
            for token in tokens:
                self._waiting.pop(token, None)
        stored = [f.done() and not f.cancelled() and f.exception() is None for f in futures]
        return stored + [False] * (len(messages) - len(stored))

    async def _on_ack(self, msg: Msg) -> None:
        future = self._waiting.pop(msg.subject.rpartition(".")[2], None)
        if future is None or future.done():
            return  # late: its batch gave up on it (and will resend it)
        if b'"error"' in msg.data or not msg.data:  # {"error": {...}}: not stored; or a no-responders status
            future.set_exception(RuntimeError(msg.data.decode(errors="replace")[:200] or "no stream answered"))
        else:
            future.set_result(None)
