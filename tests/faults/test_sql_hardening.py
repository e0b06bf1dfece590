"""Issue #25, the SQL findings and the data-file modes, attacked as a hostile operator client would: a real
nats-server, the accounting service on it with its HTTP server, and ``llmgw sql`` as a subprocess.

docs/accounting.md, "SQL limits", is what these tests hold the code to: a deadline from the start of
execution, a bounded queue (503 + Retry-After), ingest untouched by long queries, a result byte cap
(``result_too_large``), side-effect functions refused, every DuckDB type serialised alike on HTTP and the
bus, and ``llmgw sql``'s bounded connect, file fallback, time limit and Ctrl-C. docs/deploy.md: files 0600.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import stat
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from proto import AuthCheck, AuthReply, SqlQuery, UsageRecord, decode_json, encode, encode_json, subjects
from services.accounting.service import AccountingConfig, AccountingService
from services.accounting.store import Ledger
from services.common.bus import connect, ensure_bus
from services.common.nats_server import MAX_PAYLOAD_BYTES
from services.common.runtime import write_stack_file
from services.gateway.identity import IdentityStore
from services.gateway.usage_spool import UsageSpool

REPO = Path(__file__).resolve().parents[2]
ADMIN_KEY = "sk-sql-hardening-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
LONG = "SELECT count(*) FROM range(100000000000) a, range(10) b"  # hours of work: only an interrupt ends it
DEAD_NATS = "nats://127.0.0.1:1"  # nothing listens on port 1


def strict_json(text: str) -> Any:
    """JSON as RFC 8259 has it: NaN, Infinity and -Infinity are not numbers."""
    def refuse(constant: str) -> Any:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


@contextlib.asynccontextmanager
async def accounting(nats_url: str, tmp_path: Path, **kw: Any) -> AsyncIterator[AccountingService]:
    """An accounting service on its own bus connection with its HTTP server, and a stand-in for the
    gateways' key check (``llm.v1.auth.check``) that knows one admin key."""
    nc = await connect(nats_url, "accounting")
    await ensure_bus(nc)
    digest = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()

    async def answer(msg: Any) -> None:
        ok = decode_json(msg.data, AuthCheck).key_sha256 == digest
        await msg.respond(encode_json(AuthReply(ok=True, role="admin", key_id="k-admin", user="ops") if ok
                                      else AuthReply(ok=False)))

    sub = await nc.subscribe(subjects.AUTH_CHECK, cb=answer)
    service = AccountingService(nc, AccountingConfig(db_path=tmp_path / "accounting.duckdb", port=0,
                                                     fetch_timeout_s=0.2, **kw))
    task = asyncio.create_task(service.run())
    try:
        await asyncio.wait_for(service.ready.wait(), 60)
        yield service
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await sub.unsubscribe()
        await nc.close()


async def post_sql(http: aiohttp.ClientSession, service: AccountingService, sql: str
                   ) -> tuple[int, dict[str, str], Any, float]:
    t0 = time.monotonic()
    async with http.post(f"{service.url}/sql", json={"sql": sql}, headers=ADMIN) as resp:
        text = await resp.text()
        return resp.status, dict(resp.headers), strict_json(text), time.monotonic() - t0


async def bus_sql(nc: Any, sql: str, timeout_s: float = 30.0) -> tuple[dict[str, Any], int]:
    msg = await nc.request(subjects.ACCOUNTING_SQL, encode_json(SqlQuery(sql=sql)), timeout=timeout_s)
    return msgspec.json.decode(msg.data), len(msg.data)


# ---- deadline from the start of execution, queue bound, ingest alongside --------------------------------


async def test_two_long_queries_stop_at_their_limits_while_select_1_answers_and_ingest_goes_on(
        nc: Any, nats_server: Any, tmp_path: Path) -> None:
    # issue #25: with two long queries one ran 40 s and `SELECT 1` timed out behind them
    async with accounting(nats_server.url, tmp_path, query_timeout_s=3.0) as service, \
            aiohttp.ClientSession() as http:
        long = [asyncio.create_task(post_sql(http, service, LONG)) for _ in range(2)]
        await asyncio.sleep(0.5)  # both run now
        status, _, body, elapsed_s = await post_sql(http, service, "SELECT 1 AS one")
        assert (status, body) == (200, {"columns": ["one"], "rows": [[1]]})
        assert elapsed_s < 1.5, elapsed_s
        # a usage record published during the long queries lands in the ledger within seconds
        published = time.monotonic()
        await nc.jetstream().publish(subjects.usage("gw"), encode(UsageRecord(
            gateway_id="gw", session_id="g", seq=1, ts_s=time.time(), request_id="during-long-sql", model="m",
            pool="m", worker_id="w", api_key_id="k", prompt_tokens=1, output_tokens=2, latency_ms=10.0)))
        async with asyncio.timeout(10):
            while service.stats.usage_ingested < 1:
                await asyncio.sleep(0.05)
        landed_s = time.monotonic() - published
        assert not all(t.done() for t in long), "ingest must not have waited for the long queries"
        for status, _, body, elapsed_s in await asyncio.gather(*long):
            assert status == 408 and body["error"]["code"] == "query_timeout", body
            assert "3 s of execution" in body["error"]["message"]
            assert 2.5 <= elapsed_s < 6.0, elapsed_s  # each stopped at its own limit
        status, _, body, _ = await post_sql(http, service, "SELECT request_id FROM requests")
        assert body["rows"] == [["during-long-sql"]]
        print(f"\nFIGURES sql-concurrency: select1_s<1.5 usage_landed_s={landed_s:.2f} long_stopped_at_limit=3s")


async def test_a_full_query_queue_is_refused_at_once_with_503_and_retry_after_on_http_and_the_bus(
        nc: Any, nats_server: Any, tmp_path: Path) -> None:
    async with accounting(nats_server.url, tmp_path, query_timeout_s=3.0, num_query_readers=1,
                          max_queued_queries=1) as service, aiohttp.ClientSession() as http:
        long = [asyncio.create_task(post_sql(http, service, LONG)) for _ in range(2)]  # one runs, one waits
        await asyncio.sleep(0.5)
        status, headers, body, elapsed_s = await post_sql(http, service, "SELECT 1")
        assert status == 503 and body["error"]["code"] == "sql_busy", body
        assert "1 running and 1 waiting" in body["error"]["message"]
        assert 1 <= int(headers["Retry-After"]) <= 3
        assert elapsed_s < 1.0
        reply, _ = await bus_sql(nc, "SELECT 1")
        assert "too many operator queries" in reply["error"]
        results = await asyncio.gather(*long)
        assert [r[0] for r in results] == [408, 408]
        assert (await post_sql(http, service, "SELECT 2 AS n"))[2]["rows"] == [[2]]


# ---- result byte cap ------------------------------------------------------------------------------------


async def test_a_huge_result_is_refused_while_fetching_with_result_too_large(
        nats_server: Any, tmp_path: Path) -> None:
    # issue #25: 10,000 rows of 40 kB gave a 400 MB response and 1.65 GB RSS
    async with accounting(nats_server.url, tmp_path) as service, aiohttp.ClientSession() as http:
        status, _, body, elapsed_s = await post_sql(
            http, service, "SELECT i, repeat('x', 40000) AS s FROM range(10000) r(i)")
        assert status == 400, body
        error = body["error"]
        assert error["code"] == "result_too_large" and error["type"] == "invalid_request_error"
        assert f"{4 * 1024 * 1024:,} bytes" in error["message"] and "narrow the query" in error["message"]
        assert elapsed_s < 10.0
        status, _, body, _ = await post_sql(http, service, "SELECT * FROM range(10001)")
        assert status == 400 and "more than 10,000 rows" in body["error"]["message"]


async def test_a_bus_reply_over_the_payload_limit_is_answered_with_an_error_not_dropped(
        nc: Any, nats_server: Any, tmp_path: Path) -> None:
    # issue #25: a reply over the bus payload limit was never sent (the client hung 30 s)
    big = "SELECT repeat('x', 40000) AS s FROM range(300)"  # 12 MB: over the server's 8 MiB max_payload
    async with accounting(nats_server.url, tmp_path, max_result_bytes=64 * 1024 * 1024):
        t0 = time.monotonic()
        reply, size = await bus_sql(nc, big, timeout_s=20.0)
        assert "too large" in reply["error"] and "rows" not in reply, reply
        assert f"{MAX_PAYLOAD_BYTES - 4096:,} bytes" in reply["error"]
        assert time.monotonic() - t0 < 10.0
        reply, size = await bus_sql(nc, "SELECT repeat('x', 40000) AS s FROM range(150)")  # 6 MB: fits
        assert len(reply["rows"]) == 150 and size <= MAX_PAYLOAD_BYTES


# ---- refused functions ----------------------------------------------------------------------------------


async def test_checkpoint_and_other_side_effect_functions_are_refused_over_http_and_the_bus(
        nc: Any, nats_server: Any, tmp_path: Path) -> None:
    refused = ["SELECT * FROM checkpoint()", "SELECT * FROM force_checkpoint()", "SELECT * FROM query('SELECT 1')",
               "SELECT * FROM enable_logging()", "SELECT * FROM truncate_duckdb_logs()", "SELECT nextval('s')",
               "SELECT sleep_ms(60000)", "SELECT * FROM duckdb_secrets()"]
    async with accounting(nats_server.url, tmp_path) as service, aiohttp.ClientSession() as http:
        for sql in refused:
            status, _, body, _ = await post_sql(http, service, sql)
            assert status == 400 and body["error"]["code"] == "query_rejected", (sql, body)
            assert "not allowed" in body["error"]["message"], (sql, body)
            reply, _ = await bus_sql(nc, sql)
            assert "not allowed" in reply["error"], (sql, reply)
        assert (await post_sql(http, service, "SELECT count(*) AS n FROM duckdb_tables()"))[0] == 200


# ---- every type, one serialiser ------------------------------------------------------------------------

EVERY_TYPE = """SELECT INTERVAL '1 day 2 hours' AS interval, TIME '03:04:05' AS time, TIMETZ '03:04:05+02' AS timetz,
  UUID 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11' AS uuid, 1.25::DECIMAL(10, 2) AS decimal, '\\xAA'::BLOB AS blob,
  170141183460469231731687303715884105727::HUGEINT AS hugeint, [1, 2] AS list, {'a': 1} AS struct,
  MAP {'k': 1} AS map, 'b'::ENUM('a', 'b') AS enum, DATE '2026-03-01' AS date,
  TIMESTAMP '2026-03-01 12:00:00' AS timestamp, TIMESTAMPTZ '2026-03-01 12:00:00+00' AS timestamptz,
  'nan'::DOUBLE AS nan, 'inf'::DOUBLE AS inf, '-inf'::DOUBLE AS ninf"""
EVERY_TYPE_ROW = ["P1DT2H", "03:04:05", "03:04:05+02:00", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", 1.25, "aa",
                  2**127 - 1, [1, 2], {"a": 1}, {"k": 1}, "b", "2026-03-01", "2026-03-01T12:00:00",
                  "2026-03-01T12:00:00+00:00", "NaN", "Infinity", "-Infinity"]


async def test_every_duckdb_type_is_standard_json_and_the_same_on_http_and_the_bus(
        nc: Any, nats_server: Any, tmp_path: Path) -> None:
    # issue #25: POST /sql answered 500 for INTERVAL, TIME, TIMETZ and UUID, and wrote NaN/Infinity
    async with accounting(nats_server.url, tmp_path) as service, aiohttp.ClientSession() as http:
        status, _, body, _ = await post_sql(http, service, EVERY_TYPE)
        assert status == 200, body
        assert body["rows"] == [EVERY_TYPE_ROW]
        reply, _ = await bus_sql(nc, EVERY_TYPE)
        assert reply == body
        status, _, body, _ = await post_sql(http, service, "SELECT * FROM test_all_types()")
        assert status == 200 and len(body["rows"]) == 3, body
        assert (await bus_sql(nc, "SELECT * FROM test_all_types()"))[0] == body


# ---- llmgw sql ------------------------------------------------------------------------------------------


def client_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "LLMGW_DATA_DIR")}
    env["PYTHONPATH"] = str(REPO)
    return env


async def llmgw_sql(tmp_path: Path, *args: str, timeout_s: float = 60.0) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "sql", *args, "--data-dir", str(tmp_path),
        cwd=REPO, env=client_env(tmp_path), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode(), time.monotonic() - t0


@pytest.fixture
def ledger_file(tmp_path: Path) -> Path:
    db = tmp_path / "accounting.duckdb"
    Ledger(db).close()
    return db


async def test_llmgw_sql_with_a_dead_nats_url_falls_back_to_the_file_and_says_so(
        tmp_path: Path, ledger_file: Path) -> None:
    # issue #25: a dead NATS URL retried forever
    rc, out, err, elapsed_s = await llmgw_sql(tmp_path, "SELECT 7 AS n", "--nats", DEAD_NATS)
    assert rc == 0, err
    assert out.splitlines()[:3] == ["n", "-", "7"]
    assert f"no NATS server answers at {DEAD_NATS}" in err and f"reading {ledger_file} read-only instead" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert elapsed_s < 30.0


async def test_llmgw_sql_with_a_stale_stack_file_falls_back_to_the_file(tmp_path: Path, ledger_file: Path) -> None:
    # the supervisor was killed: stack.json still names its NATS
    write_stack_file(tmp_path, {"nats_url": DEAD_NATS, "gateway_url": "http://127.0.0.1:1"})
    rc, out, err, _ = await llmgw_sql(tmp_path, "SELECT count(*) AS n FROM requests", "--format", "json")
    assert rc == 0, err
    assert json.loads(out) == [{"n": 0}]
    assert "read-only instead" in err and "Traceback" not in err


async def test_llmgw_sql_prints_one_line_when_the_bus_reply_would_be_too_large(
        nats_server: Any, tmp_path: Path) -> None:
    async with accounting(nats_server.url, tmp_path / "svc", max_result_bytes=64 * 1024 * 1024):
        rc, out, err, elapsed_s = await llmgw_sql(tmp_path, "SELECT repeat('x', 40000) FROM range(300)",
                                                  "--nats", nats_server.url)
    assert rc == 1 and out == ""
    assert err.startswith("llmgw sql: the result is too large") and len(err.strip().splitlines()) == 1, err
    assert elapsed_s < 30.0


async def test_llmgw_sql_on_the_file_stops_a_long_query_at_its_time_limit(tmp_path: Path, ledger_file: Path) -> None:
    rc, _, err, elapsed_s = await llmgw_sql(tmp_path, LONG, "--timeout", "1")
    assert rc == 1
    assert err.strip() == "llmgw sql: query interrupted after 1 s of execution (the limit for operator queries)"
    assert elapsed_s < 20.0


def has_open(pid: int, path: Path) -> bool:
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                    return True
    return False


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs /proc to see when the query runs")
async def test_ctrl_c_interrupts_a_query_on_the_file_with_exit_code_130_and_no_traceback(
        tmp_path: Path, ledger_file: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "sql", LONG, "--timeout", "120", "--data-dir", str(tmp_path),
        cwd=REPO, env={**client_env(tmp_path), "PYTHONFAULTHANDLER": "1"}, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        # as a terminal starts it: a shell without job control (`.ci/run &`) starts its background jobs with
        # SIGINT ignored, the child inherits that, and Python then never turns SIGINT into KeyboardInterrupt
        # (three fresh-clone runs in the background failed here, the child's stack still in its wait loop)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        async with asyncio.timeout(60):  # process start on a loaded machine: imports, then the file opens
            while not has_open(proc.pid, ledger_file.resolve()):
                await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # the query runs
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            _, err = await asyncio.wait_for(asyncio.shield(communicated := asyncio.ensure_future(proc.communicate())),
                                            20)
        except TimeoutError:  # where it hangs: SIGABRT makes faulthandler print every thread's stack
            proc.send_signal(signal.SIGABRT)
            _, err = await asyncio.wait_for(communicated, 20)
            raise AssertionError("llmgw sql did not stop within 20 s of SIGINT:\n"
                                 + err.decode(errors="replace")) from None
        stopped_s = time.monotonic() - sent
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 130, err
    assert err.decode().strip() == "llmgw sql: interrupted"
    assert stopped_s < 10.0


# ---- data files 0600 --------------------------------------------------------------------------------------


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def usual_umask() -> Any:
    old = os.umask(0o022)  # the usual default, under which they were 0644
    yield
    os.umask(old)


async def test_the_ledger_and_its_wal_are_0600_while_the_service_writes(
        nc: Any, nats_server: Any, tmp_path: Path, usual_umask: None) -> None:
    async with accounting(nats_server.url, tmp_path / "data") as service:
        await nc.jetstream().publish(subjects.usage("gw"), encode(UsageRecord(
            gateway_id="gw", session_id="g", seq=1, ts_s=time.time(), request_id="r-mode", model="m", pool="m",
            worker_id="w", api_key_id="k", prompt_tokens=1, output_tokens=2, latency_ms=10.0)))
        async with asyncio.timeout(20):
            while service.stats.usage_ingested < 1:
                await asyncio.sleep(0.05)
        db = tmp_path / "data" / "accounting.duckdb"
        assert mode(db.parent) == 0o700 and mode(db) == 0o600
        wal = db.with_name(db.name + ".wal")
        assert wal.exists() and mode(wal) == 0o600


def test_the_usage_spool_is_0600_in_a_0700_directory_and_an_old_readable_one_is_fixed(
        tmp_path: Path, usual_umask: None) -> None:
    spool = UsageSpool(tmp_path / "usage-spool" / "gw")
    assert spool.append(b"record")
    assert mode(tmp_path / "usage-spool" / "gw") == 0o700 and mode(spool.spool) == 0o600
    spool.take()
    assert mode(spool.inflight) == 0o600
    os.chmod(spool.inflight, 0o644)
    os.chmod(spool.inflight.parent, 0o755)
    UsageSpool(tmp_path / "usage-spool" / "gw")
    assert mode(spool.inflight) == 0o600 and mode(spool.inflight.parent) == 0o700


def test_identity_db_and_its_wal_are_0600_in_a_0700_directory_and_old_readable_ones_are_fixed(
        tmp_path: Path, usual_umask: None) -> None:
    directory = tmp_path / "identity"
    store = IdentityStore(directory)
    db = directory / "identity.db"
    wal, shm = directory / "identity.db-wal", directory / "identity.db-shm"
    assert mode(directory) == 0o700 and mode(db) == 0o600
    assert wal.exists() and mode(wal) == 0o600 and mode(shm) == 0o600
    store.close()
    for path in (db, wal, shm, directory):
        if path.exists():
            os.chmod(path, 0o755 if path == directory else 0o644)
    IdentityStore(directory).close()
    assert mode(directory) == 0o700 and mode(db) == 0o600
    assert all(mode(p) == 0o600 for p in (wal, shm) if p.exists())
