"""Telemetry's I/O shell: probe HTTP members on a timer and publish their heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import aiohttp
from nats.aio.client import Client

from proto import encode, subjects
from services.common.runtime import new_session_id
from services.telemetry.probe import Member, model_ids, stock_heartbeat

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TelemetryConfig:
    members: tuple[Member, ...]
    interval_s: float = 1.0
    timeout_s: float = 2.0


class TelemetryService:
    def __init__(self, nc: Client, config: TelemetryConfig) -> None:
        self.nc = nc
        self.config = config
        self.session_id = new_session_id()
        self._seq = 0
        self._failures = {m.member_id: 0 for m in config.members}
        self._models: dict[str, list[str]] = {m.member_id: [] for m in config.members}

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                started = time.monotonic()
                await asyncio.gather(*(self._probe(http, m) for m in self.config.members))
                await asyncio.sleep(max(0.0, self.config.interval_s - (time.monotonic() - started)))

    async def _probe(self, http: aiohttp.ClientSession, member: Member) -> None:
        ok = False
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with http.get(member.url.rstrip("/") + "/v1/models") as resp:
                if resp.status == 200:
                    self._models[member.member_id] = model_ids(await resp.json(content_type=None))
                    ok = True
            if not ok:
                async with http.get(member.url.rstrip("/") + "/health") as resp:
                    ok = resp.status == 200
        was_down = self._failures[member.member_id] >= 2
        self._failures[member.member_id] = 0 if ok else self._failures[member.member_id] + 1
        if was_down and ok:
            log.info("member %s is reachable again", member.member_id)
        elif not ok and self._failures[member.member_id] == 2:
            log.warning("member %s marked down after 2 failed probes", member.member_id)
        self._seq += 1
        hb = stock_heartbeat(
            member, session_id=self.session_id, seq=self._seq, ts_s=time.time(),
            models=self._models[member.member_id], consecutive_failures=self._failures[member.member_id],
            interval_s=self.config.interval_s,
        )
        with contextlib.suppress(Exception):
            await self.nc.publish(subjects.heartbeat(member.member_id), encode(hb))
