"""A small raw client for the fault tests: every status, header and SSE event is kept, nothing retried."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class Result:
    status: int
    elapsed_s: float
    request_id: str = ""
    retry_after: str | None = None
    body: Any = None
    events: list[Any] = field(default_factory=list)
    done: bool = False  # the stream ended with data: [DONE]
    texts: int = 0

    @property
    def error_event(self) -> dict[str, Any] | None:
        return next((e["error"] for e in self.events if isinstance(e, dict) and "error" in e), None)


def chat_body(max_tokens: int, stream: bool, content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream, "ignore_eos": True, "temperature": 0, **extra}


async def post(http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str],
               on_text: Any = None, timeout_s: float = 60.0) -> Result:
    """POST ``body``; an SSE answer is read event by event (``on_text(result)`` after each content event)."""
    started = time.monotonic()
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url, data=data, headers={"Content-Type": "application/json", **headers},
                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        result = Result(resp.status, 0.0, resp.headers.get("X-Request-Id", ""), resp.headers.get("Retry-After"))
        if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    result.done = True
                    continue
                event = json.loads(payload)
                result.events.append(event)
                choices = event.get("choices") or []
                if choices and (choices[0].get("delta", {}).get("content") or choices[0].get("text")):
                    result.texts += 1
                    if on_text is not None:
                        on_text(result)
        else:
            raw = await resp.read()
            try:
                result.body = json.loads(raw)
            except ValueError:
                result.body = raw
    result.elapsed_s = time.monotonic() - started
    return result


async def keep_posting(http: aiohttp.ClientSession, url: str, headers: dict[str, str], name: str,
                       sent: list[tuple[float, Result]], stop: asyncio.Event, pause_s: float,
                       timeout_s: float = 60.0) -> None:
    """One client of a steady load, until ``stop`` is set: POST a 4-token chat request (content
    ``"{name} {n}"``, n = 1, 2, …), append (the monotonic time it was sent, the result) to ``sent``, pause
    ``pause_s``, again."""
    n = 0
    while not stop.is_set():
        n += 1
        t0 = time.monotonic()
        res = await post(http, url, chat_body(4, False, f"{name} {n}"), headers, timeout_s=timeout_s)
        sent.append((t0, res))
        await asyncio.sleep(pause_s)
