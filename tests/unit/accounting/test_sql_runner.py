"""Operator SQL on the reader pool (services/accounting/sql_runner.py; docs/accounting.md, "SQL limits"): the
deadline counts from the start of each query's execution, the queue is bounded, the result is capped while
it is fetched, and the ledger's files are the owner's alone."""

from __future__ import annotations

import concurrent.futures
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from services.accounting.sql_runner import (
    QueryBusy,
    QueryFailed,
    QueryLimits,
    QueryRunner,
    QueryTimedOut,
    ResultTooLarge,
)
from services.accounting.store import Ledger, LedgerThread, QueryRejected

LONG = "SELECT count(*) FROM range(100000000000) a, range(10) b"  # hours of work: only an interrupt ends it


def runner_on(ledger: Ledger, **limits: float) -> QueryRunner:
    limits.setdefault("num_readers", len(ledger.query_cursors))
    return QueryRunner(ledger.query_cursors, ledger.check, QueryLimits(**limits))  # type: ignore[arg-type]


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    ledger = Ledger(tmp_path / "l.duckdb", num_query_cursors=3)
    yield ledger
    ledger.close()


def finished_at(futures: list[concurrent.futures.Future[object]], t0: float) -> list[float]:
    ends: list[float] = [0.0] * len(futures)
    for i, f in enumerate(futures):
        f.add_done_callback(lambda _, i=i: ends.__setitem__(i, time.monotonic() - t0))
    concurrent.futures.wait(futures, timeout=30)
    return ends


def test_each_query_is_stopped_at_its_limit_counted_from_the_start_of_its_own_execution(ledger: Ledger) -> None:
    runner = runner_on(ledger, timeout_s=1.0, num_readers=1, max_queued=2)
    t0 = time.monotonic()
    futures = [runner.submit(LONG), runner.submit(LONG)]
    ends = finished_at(futures, t0)  # type: ignore[arg-type]
    for f in futures:
        assert isinstance(f.exception(), QueryTimedOut)
    # one reader: the second waits for the first (1 s), then runs its own full second, not 0 s
    assert 0.9 <= ends[0] < 1.9, ends
    assert 1.9 <= ends[1] < 3.4, ends
    assert runner.run("SELECT 42").rows == [[42]]  # the reader is free and outside any transaction
    runner.close()


def test_close_stops_a_query_that_had_not_begun_executing_when_it_was_asked(ledger: Ledger) -> None:
    """DuckDB interrupts only a running query: one asked to stop between its start and its execute used to run
    its whole limit (Ctrl-C in ``llmgw sql`` just as its query started hung; a fresh-clone run caught it)."""
    checking = threading.Event()

    def slow_check(cursor: object, text: str) -> object:
        checking.set()
        time.sleep(0.3)  # registered as running, not executing yet: an interrupt now reaches no query
        return ledger.check(cursor, text)  # type: ignore[arg-type]

    runner = QueryRunner(ledger.query_cursors, slow_check, QueryLimits(timeout_s=60.0, num_readers=3))  # type: ignore[arg-type]
    future = runner.submit(LONG)
    assert checking.wait(10)
    t0 = time.monotonic()
    runner.close()
    assert time.monotonic() - t0 < 10.0  # not the query's 60 s
    assert isinstance(future.exception(timeout=1), QueryFailed)
    with pytest.raises(QueryBusy):  # and nothing starts after
        runner.submit("SELECT 1")


def test_select_1_beside_two_long_queries_answers_at_once_on_another_reader(ledger: Ledger) -> None:
    runner = runner_on(ledger, timeout_s=3.0, num_readers=3)
    long = [runner.submit(LONG), runner.submit(LONG)]
    time.sleep(0.3)  # both are running
    t0 = time.monotonic()
    assert runner.run("SELECT 1 AS one").rows == [[1]]
    assert time.monotonic() - t0 < 1.0
    for f in long:
        assert isinstance(f.exception(timeout=10), QueryTimedOut)
    runner.close()


def test_a_full_queue_is_refused_at_once_with_a_retry_after(ledger: Ledger) -> None:
    runner = runner_on(ledger, timeout_s=2.0, num_readers=1, max_queued=1)
    pending = [runner.submit(LONG), runner.submit(LONG)]
    t0 = time.monotonic()
    with pytest.raises(QueryBusy) as refused:
        runner.submit("SELECT 1")
    assert time.monotonic() - t0 < 0.1
    assert "1 running and 1 waiting" in str(refused.value)
    assert 1.0 <= refused.value.retry_after_s <= 2.0  # when the running one must have ended
    for f in pending:
        assert isinstance(f.exception(timeout=10), QueryTimedOut)
    assert runner.run("SELECT 2").rows == [[2]]  # the queue drained: room again
    runner.close()


def test_a_query_that_waited_twice_its_limit_for_a_reader_is_refused_without_running(ledger: Ledger) -> None:
    runner = runner_on(ledger, timeout_s=0.5, num_readers=1, max_queued=3)
    futures = [runner.submit(LONG) for _ in range(3)] + [runner.submit("SELECT 1")]
    concurrent.futures.wait(futures, timeout=30)
    assert [type(f.exception()) for f in futures] == [QueryTimedOut, QueryTimedOut, QueryBusy, QueryBusy]
    assert "waited" in str(futures[3].exception())
    runner.close()


def test_a_result_past_the_byte_cap_stops_while_fetching_with_a_clear_error(ledger: Ledger) -> None:
    # issue #25: 10,000 rows of 40 kB made a 400 MB answer and 1.65 GB RSS
    runner = runner_on(ledger, max_result_bytes=1024 * 1024)
    t0 = time.monotonic()
    with pytest.raises(ResultTooLarge) as too_large:
        runner.run("SELECT i, repeat('x', 40000) AS s FROM range(10000) r(i)")
    assert time.monotonic() - t0 < 5.0
    message = str(too_large.value)
    assert "1,048,576 bytes" in message and "narrow the query" in message
    assert too_large.value.num_rows == (1024 * 1024) // 40_000  # 26 rows fit, the 27th does not
    assert runner.run("SELECT 3").rows == [[3]]
    runner.close()


def test_a_result_past_the_row_cap_is_an_error_not_a_silent_cut(ledger: Ledger) -> None:
    runner = runner_on(ledger, max_rows=10)
    assert len(runner.run("SELECT * FROM range(10)").rows) == 10
    with pytest.raises(ResultTooLarge, match="more than 10 rows"):
        runner.run("SELECT * FROM range(11)")
    runner.close()


def test_the_counted_bytes_are_the_bytes_of_the_json_answer(ledger: Ledger) -> None:
    runner = runner_on(ledger)
    result = runner.run("SELECT i, 'x' || i AS s, INTERVAL 1 HOUR * i AS d FROM range(100) r(i)")
    assert result.num_bytes == len(msgspec.json.encode({"columns": result.columns, "rows": result.rows}))
    exact = result.num_bytes
    with pytest.raises(ResultTooLarge):
        runner.run("SELECT i, 'x' || i AS s, INTERVAL 1 HOUR * i AS d FROM range(100) r(i)", max_bytes=exact - 1)
    assert runner.run("SELECT i, 'x' || i AS s, INTERVAL 1 HOUR * i AS d FROM range(100) r(i)",
                      max_bytes=exact).num_bytes == exact
    runner.close()


def test_checkpoint_is_refused_and_leaves_the_wal_alone(tmp_path: Path) -> None:
    # issue #25: `SELECT * FROM checkpoint()` passed the guard and wrote the file, even in a read-only transaction
    ledger = Ledger(tmp_path / "l.duckdb")
    ledger.con.execute("INSERT INTO tariff VALUES (now(), 0.1, 'test')")
    wal = tmp_path / "l.duckdb.wal"
    assert wal.exists()
    for sql in ("SELECT * FROM checkpoint()", "SELECT * FROM force_checkpoint()",
                "SELECT (SELECT 1 FROM checkpoint()) AS x"):
        with pytest.raises(QueryRejected, match="not allowed"):
            ledger.query(sql)
        runner = runner_on(ledger)
        with pytest.raises(QueryRejected, match="not allowed"):
            runner.run(sql)
        runner.close()
    assert wal.exists()
    ledger.close()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_ledger_file_and_its_wal_are_0600_in_a_0700_directory(tmp_path: Path) -> None:
    old_umask = os.umask(0o022)  # the usual default, which made them 0644
    try:
        db = tmp_path / "new" / "accounting.duckdb"
        thread = LedgerThread(db)
        assert mode(db.parent) == 0o700
        assert mode(db) == 0o600
        # a checkpoint removes the WAL; the next write creates a new one, which must be private too
        thread.submit(lambda ledger: ledger.con.execute("CHECKPOINT")).result()
        thread.submit(lambda ledger: ledger.con.execute("INSERT INTO tariff VALUES (now(), 0.2, 't')")).result()
        wal = db.with_name(db.name + ".wal")
        assert wal.exists() and mode(wal) == 0o600
        thread.close()
        # an existing file left readable by an older version is made private at start
        os.chmod(db, 0o644)
        Ledger(db).close()
        assert mode(db) == 0o600
    finally:
        os.umask(old_umask)
