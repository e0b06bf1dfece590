"""Reads one HTTP member: detects what it speaks once, then asks only the endpoints its kind needs.

Detection (first scrape, and again after any failure), in this order because engines overlap — NInfer
forks and our engine also export ``llamacpp:*`` and ``vllm:*`` metrics, so ``/slots`` decides first:

1. ``GET /slots``: an object with a non-zero ``max_concurrency`` → ninfer (+ ``GET /usage``);
   a JSON array → llamacpp (+ ``GET /metrics`` when it answers, i.e. llama.cpp runs with ``--metrics``);
2. ``GET /metrics`` with ``vllm:*`` / ``sglang:*`` / ``llamacpp:*`` families → that kind;
3. ``GET /v1/models``, else ``GET /health`` → stock (reachable, no load signal).

Per scrape afterwards: ninfer 2 requests (``/slots``, ``/usage`` concurrently), vllm/sglang 1, llamacpp 1 or 2,
stock 1. ``/v1/models`` (model id, vLLM's ``max_model_len``) is read at detection only.

A member with a key in the pools file gets it as ``Authorization: Bearer`` on every request, not only
``/v1/*`` (vLLM's ``--api-key`` guards only ``/v1``, but a hosted API or a proxy in front may guard all).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from proto.fleet import EngineKind
from services.telemetry import normalize as n
from services.telemetry.probe import Member
from services.telemetry.promparse import Exposition, PromParseError, parse

_json = msgspec.json.Decoder()


def _auth(member: Member) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {member.api_key}"} if member.api_key else None


class ScrapeError(Exception):
    """One scrape of ``member_id`` failed at ``endpoint`` (connection, status, body or timeout)."""

    def __init__(self, member_id: str, endpoint: str, reason: str) -> None:
        super().__init__(f"{member_id} {endpoint}: {reason}")
        self.member_id = member_id
        self.endpoint = endpoint
        self.reason = reason


@dataclass(frozen=True)
class Knowledge:
    """What detection learned about a member; ``kind`` None means "detect on the next scrape"."""

    kind: EngineKind | None = None
    models: n.ModelsInfo = field(default_factory=n.ModelsInfo)
    has_slots: bool = False  # llama.cpp: /slots answers (it can be switched off)
    has_metrics: bool = False  # llama.cpp: /metrics answers (only with --metrics)
    has_models: bool = False  # stock: /v1/models answers (else /health is the probe)


class Scraper:
    """Shares one aiohttp session (one connection pool, keep-alive) across every member."""

    def __init__(self, http: aiohttp.ClientSession) -> None:
        self.http = http

    async def _fetch(self, member: Member, path: str) -> bytes:
        try:
            async with self.http.get(member.url.rstrip("/") + path, headers=_auth(member)) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise ScrapeError(member.member_id, path, f"HTTP {resp.status}")
                return body
        except aiohttp.ClientError as exc:
            raise ScrapeError(member.member_id, path, f"{type(exc).__name__}: {exc}") from None

    async def _health(self, member: Member) -> None:
        """``GET /health`` answers 200; a body that claims to be JSON must be JSON (a server answering
        garbage everywhere is broken, not "reachable")."""
        try:
            async with self.http.get(member.url.rstrip("/") + "/health", headers=_auth(member)) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise ScrapeError(member.member_id, "/health", f"HTTP {resp.status}")
                is_json = resp.content_type == "application/json"
        except aiohttp.ClientError as exc:
            raise ScrapeError(member.member_id, "/health", f"{type(exc).__name__}: {exc}") from None
        if is_json:
            try:
                _json.decode(body)
            except msgspec.DecodeError:
                raise ScrapeError(member.member_id, "/health", "claims JSON, is not JSON") from None

    async def _json(self, member: Member, path: str) -> Any:
        body = await self._fetch(member, path)
        try:
            return _json.decode(body)
        except msgspec.DecodeError:
            raise ScrapeError(member.member_id, path, "not JSON") from None

    async def _metrics(self, member: Member) -> Exposition:
        body = await self._fetch(member, "/metrics")
        try:
            return parse(body.decode("utf-8", "replace"), n.wanted_family)
        except PromParseError as exc:
            raise ScrapeError(member.member_id, "/metrics", str(exc)) from None

    async def _optional(self, fetch: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """An endpoint whose absence costs fields, not the scrape. Takes the fetch and its arguments, not a
        coroutine: one made before a cancelled gather started this would be reported as never awaited."""
        try:
            return await fetch(*args)
        except ScrapeError:
            return None

    async def _models(self, member: Member) -> n.ModelsInfo | None:
        body = await self._optional(self._json, member, "/v1/models")
        try:
            return None if body is None else n.models_info(body)
        except n.MalformedBody:
            return None

    def _checked(self, member: Member, normalise: Any, *args: Any) -> Any:
        """Run a normaliser; a body it rejects fails the scrape like a bad status would."""
        try:
            return normalise(*args)
        except n.MalformedBody as exc:
            raise ScrapeError(member.member_id, exc.endpoint, exc.reason) from None

    async def scrape(self, member: Member, known: Knowledge) -> tuple[n.Reading, Knowledge]:
        """One reading; raises ScrapeError. The caller bounds it with a deadline and forgets ``known``
        after a failure, so a member that was replaced by another engine is detected afresh."""
        if known.kind is None:
            return await self._detect(member)
        if known.kind == "ninfer":
            slots, usage = await asyncio.gather(self._json(member, "/slots"),
                                                self._optional(self._json, member, "/usage"))
            return n.with_model(self._checked(member, n.ninfer_reading, slots, usage), known.models), known
        if known.kind == "llamacpp":
            slots = await self._json(member, "/slots") if known.has_slots else None
            metrics = None
            if known.has_metrics:
                metrics = await (self._optional(self._metrics, member) if known.has_slots else self._metrics(member))
            return self._checked(member, n.llamacpp_reading, slots, metrics, known.models), known
        if known.kind == "vllm":
            return self._checked(member, n.vllm_reading, await self._metrics(member), known.models, member.lanes), known
        if known.kind == "sglang":
            return self._checked(member, n.sglang_reading, await self._metrics(member), known.models), known
        if known.has_models:
            models = self._checked(member, n.models_info, await self._json(member, "/v1/models"))
        else:
            await self._health(member)
            models = known.models
        return n.stock_reading(models), known

    async def _detect(self, member: Member) -> tuple[n.Reading, Knowledge]:
        slots = await self._optional(self._json, member, "/slots")
        if n.is_ninfer_slots(slots):
            usage = await self._optional(self._json, member, "/usage")
            models = await self._models(member) or n.ModelsInfo()
            reading = n.with_model(self._checked(member, n.ninfer_reading, slots, usage), models)
            return reading, Knowledge("ninfer", models)
        metrics = await self._optional(self._metrics, member)
        kind = n.metrics_kind(metrics) if metrics is not None else None
        listed = await self._models(member)
        has_models = listed is not None
        models = listed or n.ModelsInfo()
        if isinstance(slots, list) and slots:
            known = Knowledge("llamacpp", models, has_slots=True, has_metrics=kind == "llamacpp")
            return self._checked(member, n.llamacpp_reading, slots, metrics if known.has_metrics else None,
                              models), known
        if kind == "llamacpp":
            return (self._checked(member, n.llamacpp_reading, None, metrics, models),
                    Knowledge("llamacpp", models, has_metrics=True))
        if kind == "vllm":
            return self._checked(member, n.vllm_reading, metrics, models, member.lanes), Knowledge("vllm", models)
        if kind == "sglang":
            return self._checked(member, n.sglang_reading, metrics, models), Knowledge("sglang", models)
        if not has_models:
            await self._health(member)
        return n.stock_reading(models), Knowledge("stock", models, has_models=has_models)
