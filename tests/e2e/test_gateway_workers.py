"""``llmgw gateway --workers 2`` (services/gateway/workers.py): two real gateway processes on one port, a real
nats-server, the official openai client, and an OpenAI-compatible upstream (bench/gateway_overhead.py's null
engine, its own process). docs/reliability.md, "Gateway workers"."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from proto import LimitCounters, decode, subjects
from services.common.bus import connect
from services.common.nats_server import EmbeddedNatsServer
from services.gateway.identity import IdentityStore, hash_password
from tests.e2e.procs import REPO, Followed

START_TIMEOUT_S = 180.0  # several Python processes on a loaded 2-core machine
TOKENS_PER_REQUEST = 8 + 16  # the null engine's usage: 8 prompt tokens, 16 completion tokens
QUOTA_TOKENS = 100  # → 5 requests admitted fleet-wide: after 4 (96 tokens) there is room, after 5 (120) none


@contextlib.contextmanager
def null_engine() -> Iterator[str]:
    proc = Followed([sys.executable, str(REPO / "bench" / "gateway_overhead.py"), "--serve-null", "0"],
                    "null engine ready: ")
    try:
        yield proc.wait_ready(START_TIMEOUT_S).split("ready: ", 1)[1].strip()
    finally:
        proc.proc.kill()
        proc.proc.wait()


def worker_pids(parent: int) -> set[int]:
    return {int(p) for p in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()}


# the gateway as `llmgw gateway` runs it where the platform has no SO_REUSEPORT: the parent listens and hands
# the socket down to the workers (which run unchanged: they get --listen-fd)
NO_REUSEPORT = ["-c", "import socket, sys; del socket.SO_REUSEPORT; from services.gateway.__main__ import main; main()"]


@contextlib.contextmanager
def gateway(nats_url: str, data: Path, upstream: str, how: list[str] | None = None) -> Iterator[tuple[Followed, str]]:
    data.mkdir(parents=True, exist_ok=True)
    pools = data / "pools.json"
    pools.write_text(json.dumps({"model_pools": {"null": {"members": [{"model_id": "null", "backend": upstream}]}}}))
    followed = Followed([sys.executable, *(how or ["-m", "services.gateway"]), "--workers", "2", "--port", "0",
                         "--nats", nats_url, "--data-dir", str(data), "--config", str(pools), "--gateway-id", "gwk"],
                        "llmgw gateway ready: ", env={**os.environ, "LLMGW_LOG_LEVEL": "INFO"})
    try:
        line = followed.wait_ready(START_TIMEOUT_S)
        yield followed, re.search(r"listening on (\S+)", line).group(1)  # type: ignore[union-attr]
    finally:
        if followed.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                for pid in worker_pids(followed.proc.pid):
                    os.kill(pid, signal.SIGKILL)
            followed.proc.kill()
        followed.proc.wait()


def make_key(data: Path, daily_quota: int | None) -> str:
    """A user and API key in the data directory's identity store, before the gateway starts (as `llmgw up` does)."""
    store = IdentityStore(data / "identity")
    try:
        user = store.create_user("bob", hash_password("bob-password-1"), "user")
        key, _ = store.create_key(user.user_id, "test", daily_quota, time.time())
        return key
    finally:
        store.close()


def chat(url: str, key: str) -> openai.types.chat.ChatCompletion:
    # a new client (a new connection) each time, so the kernel may hand it to either worker
    with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60) as client:
        return client.chat.completions.create(model="null", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=16)


def health_ids(url: str, tries: int = 40) -> set[str]:
    ids = set()
    for _ in range(tries):
        ids.add(httpx.get(f"{url}/health", timeout=60).json()["gateway_id"])
    return ids


def metric(text: str, name: str, **labels: str) -> list[float]:
    found = []
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                found.append(float(line.rsplit(" ", 1)[1]))
    return found


@pytest.fixture
async def nats(tmp_path: Path):
    async with EmbeddedNatsServer(tmp_path / "nats") as server:
        yield server


@pytest.mark.parametrize("how", ["SO_REUSEPORT", "socket handed down"])
async def test_two_workers_serve_one_port_and_every_scrape_holds_both(nats, tmp_path: Path, how: str) -> None:
    key = make_key(tmp_path / "data", None)
    with null_engine() as upstream, gateway(nats.url, tmp_path / "data", upstream,
                                            NO_REUSEPORT if how == "socket handed down" else None) as (proc, url):
        assert proc.output.count("llmgw gateway ready: ") == 1  # one readiness line for the whole gateway
        assert f"({how if how == 'SO_REUSEPORT' else 'one listening socket handed down'})" in proc.output
        assert len(worker_pids(proc.proc.pid)) == 2
        for _ in range(20):
            assert (await asyncio.to_thread(chat, url, key)).choices[0].message.content == "x" * 16
        # both workers answer on the one port, each with its own replica id
        assert await asyncio.to_thread(health_ids, url) == {"gwk-w0", "gwk-w1"}
        text = (await asyncio.to_thread(httpx.get, f"{url}/metrics", timeout=60)).text
        assert metric(text, "llmgw_gateway_workers") == [2.0]
        assert metric(text, "llmgw_gateway_workers_reporting") == [2.0]
        # each worker's counters under its own label, and their sum is every request the test made
        ok_per_worker = [sum(metric(text, "llmgw_requests_total", worker=w, status="ok")) for w in ("w0", "w1")]
        assert sum(ok_per_worker) == 20 and all(n > 0 for n in ok_per_worker), ok_per_worker


async def test_a_worker_killed_is_restarted_and_requests_keep_succeeding(nats, tmp_path: Path) -> None:
    key = make_key(tmp_path / "data", None)
    with null_engine() as upstream, gateway(nats.url, tmp_path / "data", upstream) as (proc, url):
        before = worker_pids(proc.proc.pid)
        victim = min(before)
        os.kill(victim, signal.SIGKILL)
        await asyncio.to_thread(proc.line_with, "exited with signal 9", START_TIMEOUT_S)
        # the survivor takes every new connection while the other is down or starting again
        for _ in range(10):
            assert (await asyncio.to_thread(chat, url, key)).choices[0].message.content == "x" * 16
        await asyncio.to_thread(proc.line_with, "serving again", START_TIMEOUT_S)
        after = worker_pids(proc.proc.pid)
        assert len(after) == 2 and victim not in after and before - {victim} <= after
        for _ in range(10):
            assert (await asyncio.to_thread(chat, url, key)).choices[0].message.content == "x" * 16
        assert await asyncio.to_thread(health_ids, url) == {"gwk-w0", "gwk-w1"}  # the slot keeps its id

        # SIGTERM to the gateway stops every worker, and the gateway exits cleanly
        workers = worker_pids(proc.proc.pid)
        proc.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.proc.wait, START_TIMEOUT_S) == 0
        for pid in workers:
            assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


async def test_one_keys_quota_holds_across_the_workers(nats, tmp_path: Path) -> None:
    """Each worker counts its own requests and shares its counters on the bus (limits.py): the key's daily
    quota binds the two together, not each one (which would admit twice as many requests)."""
    key = make_key(tmp_path / "data", QUOTA_TOKENS)
    counted: dict[str, float] = {}  # tokens per day each worker says it counted, by worker gateway id

    def on_counters(data: bytes) -> None:
        msg = decode(data, LimitCounters)
        counted[msg.gateway_id] = sum(v for k, v in msg.counters.items()
                                      if k.startswith("key-") and "|tokens_per_day|" in k)

    nc = await connect(nats.url, "test")
    try:
        async def cb(msg) -> None:
            on_counters(msg.data)
        await nc.subscribe(subjects.QUOTA_ALL, cb=cb)
        with null_engine() as upstream, gateway(nats.url, tmp_path / "data", upstream) as (_, url):
            statuses: list[int] = []
            for _ in range(16):
                try:
                    await asyncio.to_thread(chat, url, key)
                    statuses.append(200)
                except openai.RateLimitError as exc:
                    statuses.append(429)
                    assert exc.code == "quota_exceeded"
                    continue
                # wait until the workers' shared counters hold this request (settled), so the next request,
                # whichever worker takes it, is judged on the fleet's count (the share period is 1 s)
                admitted = statuses.count(200)
                async with asyncio.timeout(START_TIMEOUT_S):
                    while sum(counted.values()) < admitted * TOKENS_PER_REQUEST:
                        await asyncio.sleep(0.05)
            text = (await asyncio.to_thread(httpx.get, f"{url}/metrics", timeout=60)).text
    finally:
        await nc.drain()
    # 5 requests fit in the quota (4 x 24 = 96 < 100 leaves room for one more); the rest are refused
    assert statuses == [200] * 5 + [429] * 11, statuses
    assert set(counted) == {"gwk-w0", "gwk-w1"}
    # both workers took part: each admitted or refused some of the requests
    per_worker = [sum(metric(text, "llmgw_requests_total", worker=w)) for w in ("w0", "w1")]
    assert all(n > 0 for n in per_worker), per_worker


async def test_when_the_parent_is_killed_its_workers_stop_too(nats, tmp_path: Path) -> None:
    with null_engine() as upstream, gateway(nats.url, tmp_path / "data", upstream) as (proc, _):
        workers = worker_pids(proc.proc.pid)
        assert len(workers) == 2
        proc.proc.kill()  # SIGKILL: no chance to stop them itself; the kernel tells them (PR_SET_PDEATHSIG)
        proc.proc.wait()

        def gone() -> bool:
            return all(not Path(f"/proc/{pid}").exists()
                       or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z" for pid in workers)

        async with asyncio.timeout(START_TIMEOUT_S):
            while not gone():
                await asyncio.sleep(0.1)
