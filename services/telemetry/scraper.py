"""Reads one HTTP member: detects what it speaks once, then asks only the endpoints its kind needs.

Detection (first scrape, and again after any failure), in this order because engines overlap — NInfer
forks and our engine also export ``llamacpp:*`` and ``vllm:*`` metrics, so ``/slots`` decides first:

1. ``GET /slots``: an object with a non-zero ``max_concurrency`` → ninfer (+ ``GET /usage``);
   a JSON array → llamacpp (+ ``GET /metrics`` when it answers, i.e. llama.cpp runs with ``--metrics``);
2. ``GET /metrics`` with ``vllm:*`` / ``sglang:*`` / ``llamacpp:*`` families → that kind;
   SGLang: + ``GET /server_info`` (older builds ``/get_server_info``) for lanes, KV capacity and context;
3. ``GET /props`` with ``total_slots`` → llamacpp (asked for every llama.cpp, and before calling a member
   stock: a llama.cpp started with ``--no-slots`` and without ``--metrics`` answers only it);
4. ``GET /v1/models``, else ``GET /health`` → stock (reachable, no load signal).

Per scrape afterwards: ninfer 2 requests (``/slots``, ``/usage`` concurrently), vllm/sglang 1, llamacpp 1 or 2
(``/props`` alone when it answers nothing else), stock 1. ``/v1/models`` (model id, vLLM's ``max_model_len``),
``/props`` and SGLang's server info are read at detection only: what they say is fixed for the process.

Requests (docs/telemetry.md, "Health and freshness"): each has its own deadline, ``request_timeout_s``; one that
times out, cannot connect or answers 5xx (but 501, llama.cpp's "switched off") is asked once more at once,
within the same scrape. An endpoint that answers a status or a body it should not costs the fields it would
give (at detection: it is absent); one that still does not answer after its retry fails the whole scrape.

A member with a key in the pools file gets it as ``Authorization: Bearer`` on every request, not only
``/v1/*`` (vLLM's ``--api-key`` guards only ``/v1``, but a hosted API or a proxy in front may guard all).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from proto.fleet import EngineKind
from services.common.runtime import raise_if_cancelling
from services.telemetry import normalize as n
from services.telemetry.probe import Member
from services.telemetry.promparse import Exposition, PromParseError, parse

_json = msgspec.json.Decoder()


def _auth(member: Member) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {member.api_key}"} if member.api_key else None


# 501 Not Implemented is an answer, not a failure: llama.cpp's /slots and /metrics when switched off.
_NOT_IMPLEMENTED = 501


def is_retryable_status(status: int) -> bool:
    return status >= 500 and status != _NOT_IMPLEMENTED


class ScrapeError(Exception):
    """One scrape of ``member_id`` failed at ``endpoint`` (connection, status, body or timeout).
    ``is_transport``: no answer at all (timeout, connection error), after the retry."""

    def __init__(self, member_id: str, endpoint: str, reason: str, *, is_transport: bool = False) -> None:
        super().__init__(f"{member_id} {endpoint}: {reason}")
        self.member_id = member_id
        self.endpoint = endpoint
        self.reason = reason
        self.is_transport = is_transport


@dataclass(frozen=True)
class Knowledge:
    """What detection learned about a member; ``kind`` None means "detect on the next scrape"."""

    kind: EngineKind | None = None
    models: n.ModelsInfo = field(default_factory=n.ModelsInfo)
    has_slots: bool = False  # llama.cpp: /slots answers (it can be switched off)
    has_metrics: bool = False  # llama.cpp: /metrics answers (only with --metrics)
    has_models: bool = False  # stock: /v1/models answers (else /health is the probe)
    info: n.EngineInfo | None = None  # llama.cpp /props, SGLang server info


class Scraper:
    """Shares one aiohttp session (one connection pool, keep-alive) across every member.

    ``request_timeout_s`` bounds each request (the service sets it: ``--timeout``, at most the scrape
    interval); ``retries_total`` counts, per member, the requests asked a second time."""

    def __init__(self, http: aiohttp.ClientSession, request_timeout_s: float) -> None:
        self.http = http
        self.request_timeout_s = request_timeout_s
        self.retries_total: collections.Counter[str] = collections.Counter()

    async def _get_once(self, member: Member, path: str) -> tuple[int, bytes, str]:
        timeout_s = self.request_timeout_s
        try:
            async with asyncio.timeout(timeout_s), \
                    self.http.get(member.url.rstrip("/") + path, headers=_auth(member)) as resp:
                return resp.status, await resp.read(), resp.content_type
        except TimeoutError:
            raise_if_cancelling()
            raise ScrapeError(member.member_id, path, f"no answer within {timeout_s:g}s", is_transport=True) from None
        except aiohttp.ClientError as exc:
            raise ScrapeError(member.member_id, path, f"{type(exc).__name__}: {exc}", is_transport=True) from None

    async def _get(self, member: Member, path: str) -> tuple[int, bytes, str]:
        """One request, asked once more at once when it timed out, could not connect or answered 5xx."""
        try:
            answer = await self._get_once(member, path)
            if not is_retryable_status(answer[0]):
                return answer
        except ScrapeError:
            pass
        self.retries_total[member.member_id] += 1
        return await self._get_once(member, path)

    async def _fetch(self, member: Member, path: str) -> bytes:
        status, body, _ = await self._get(member, path)
        if status != 200:
            raise ScrapeError(member.member_id, path, f"HTTP {status}")
        return body

    async def _health(self, member: Member) -> None:
        """``GET /health`` answers 200; a body that claims to be JSON must be JSON (a server answering
        garbage everywhere is broken, not "reachable")."""
        status, body, content_type = await self._get(member, "/health")
        if status != 200:
            raise ScrapeError(member.member_id, "/health", f"HTTP {status}")
        if content_type == "application/json":
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
        """An endpoint whose absence (a status, a body it should not answer) costs fields, not the scrape; one
        that does not answer at all, even on its retry, fails the scrape. Takes the fetch and its arguments,
        not a coroutine: one made before a cancelled gather started this would be reported as never awaited."""
        try:
            return await fetch(*args)
        except ScrapeError as exc:
            if exc.is_transport:
                raise
            return None

    async def _props(self, member: Member) -> n.EngineInfo | None:
        """llama.cpp's ``/props``, when this is a llama.cpp."""
        body = await self._optional(self._json, member, "/props")
        return n.llamacpp_props(body) if n.is_llamacpp_props(body) else None

    async def _server_info(self, member: Member) -> n.EngineInfo | None:
        """SGLang's server info: ``/server_info`` (current), else ``/get_server_info`` (older builds)."""
        for path in ("/server_info", "/get_server_info"):
            body = await self._optional(self._json, member, path)
            if body is not None:
                try:
                    return n.sglang_server_info(body, path)
                except n.MalformedBody:
                    return None
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
            info = known.info
            if not known.has_slots and not known.has_metrics:  # --no-slots, no --metrics: /props is the probe
                info = self._checked(member, n.llamacpp_props, await self._json(member, "/props"))
            return self._checked(member, n.llamacpp_reading, slots, metrics, known.models, info), known
        if known.kind == "vllm":
            return self._checked(member, n.vllm_reading, await self._metrics(member), known.models), known
        if known.kind == "sglang":
            return self._checked(member, n.sglang_reading, await self._metrics(member), known.models,
                                 known.info), known
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
        has_slots = isinstance(slots, list) and bool(slots)
        if has_slots or kind in ("llamacpp", None):
            props = await self._props(member)
            if has_slots or kind == "llamacpp" or props is not None:
                known = Knowledge("llamacpp", models, has_slots=has_slots, has_metrics=kind == "llamacpp",
                                  info=props)
                return self._checked(member, n.llamacpp_reading, slots if has_slots else None,
                                     metrics if known.has_metrics else None, models, props), known
        if kind == "vllm":
            return self._checked(member, n.vllm_reading, metrics, models), Knowledge("vllm", models)
        if kind == "sglang":
            info = await self._server_info(member)
            reading = self._checked(member, n.sglang_reading, metrics, models, info)
            return reading, Knowledge("sglang", models, info=info)
        if not has_models:
            await self._health(member)
        return n.stock_reading(models), Knowledge("stock", models, has_models=has_models)
