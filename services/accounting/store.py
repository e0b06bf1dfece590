"""The DuckDB ledger: ingest, derived intervals, rollups, retention, costs and the operator SQL guard.

Threads: every write runs on one writer thread (:class:`LedgerThread`); operator SQL runs on a small pool
of reader threads, each with its own cursor (``Ledger.query_cursors``, sql_runner.py), inside a read-only
transaction, so a slow query never holds up ingest and can be interrupted alone.

The database is opened with ``enable_external_access = false`` and its configuration is locked once
the connections exist: no statement run here (ours or an operator's) can read or write a file, attach
a database, or install/load an extension. The Parquet export therefore copies rows into a separate
in-memory DuckDB that may write files (:meth:`Ledger.export_parquet`).

Operator SQL is checked twice before it runs (:func:`check_query`): one SELECT statement, and the
functions it calls (sql_guard.py: ``checkpoint()`` and the like write even in a read-only transaction).
A separate read-only connection to the file is not possible in this process (DuckDB refuses a second
configuration of an open database), so the read-only transaction is the database-side layer.

Files: the database file and its ``.wal`` are made 0600 (owner only) when opened and after every write
batch (DuckDB creates a new ``.wal`` after each checkpoint with the process umask, which
``llmgw accounting`` sets to 077), and a directory created for them is 0700.
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import json
import math
import os
import stat
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import duckdb

from proto import CostsReport, EnergySample, UsageRecord
from services.accounting import costs, schema, sql_guard, sql_values
from services.accounting.device_stream import Part, StreamSample, split
from services.accounting.intervals import Limits, Reading, Sample, TokenCount, sample_of
from services.common.energy_counter import US_PER_S, epoch_us

T = TypeVar("T")

HOUR_S = 3600
# A usage record's ``ts`` is its gateway's clock, an energy share's times its engine's. Hosts on NTP agree
# to milliseconds; this much disagreement is allowed before a request is missed by the key-energy figure's
# time bound on ``requests`` (and then only until the hour's next refresh, which joins without one).
CLOCK_SKEW = dt.timedelta(hours=1)

# What a ledger write raises when a *value* cannot be stored (the transaction has been rolled back):
# DuckDB refusing it (a constraint, a conversion out of range, bad input) or Python failing to convert it
# first (a timestamp past year 9999). The service parks such a message instead of failing its batch
# forever. Not here: I/O, memory or transaction trouble (duckdb.OperationalError), which is no message's
# fault; parking on it would terminate every message of a batch while the disk is full.
REFUSED_VALUE_ERRORS: tuple[type[Exception], ...] = (
    duckdb.DataError, duckdb.IntegrityError, duckdb.InvalidInputException, OverflowError, ValueError)
# Anything a ledger call may raise (the transaction has been rolled back).
LEDGER_ERRORS: tuple[type[Exception], ...] = (duckdb.Error, OverflowError, ValueError)

DATED_RATE_SOURCE = "--tariff"
"""``tariff.source`` of a rate entered with a date (:meth:`Ledger.add_dated_rate`); other sources are the
configured rate (:meth:`Ledger.set_tariff`)."""

_USAGE_COLUMNS = (
    ("request_id", "VARCHAR"), ("ts", "TIMESTAMPTZ"), ("gateway_id", "VARCHAR"), ("gateway_session", "VARCHAR"),
    ("gateway_seq", "BIGINT"), ("model", "VARCHAR"), ("pool", "VARCHAR"), ("member", "VARCHAR"),
    ("worker_id", "VARCHAR"), ("api_key_id", "VARCHAR"), ("endpoint", "VARCHAR"), ("stream", "BOOLEAN"),
    ("status", "VARCHAR"), ("http_status", "INTEGER"), ("finish_reason", "VARCHAR"), ("error_code", "VARCHAR"),
    ("prompt_tokens", "BIGINT"), ("cached_tokens", "BIGINT"), ("output_tokens", "BIGINT"), ("ttft_ms", "DOUBLE"),
    ("latency_ms", "DOUBLE"), ("routing_reason", "VARCHAR"), ("usage_source", "VARCHAR"), ("limit_kind", "VARCHAR"),
    ("user_id", "VARCHAR"),
)
_INTERVAL_COLUMNS = (
    ("worker_id", "VARCHAR"), ("session_id", "VARCHAR"), ("device_id", "VARCHAR"), ("start_seq", "BIGINT"),
    ("end_seq", "BIGINT"), ("start_ts", "TIMESTAMPTZ"), ("end_ts", "TIMESTAMPTZ"), ("model_id", "VARCHAR"),
    ("kind", "VARCHAR"), ("method", "VARCHAR"), ("energy_j", "DOUBLE"), ("device_s", "DOUBLE"),
    ("is_reset", "BOOLEAN"), ("is_wrap", "BOOLEAN"), ("is_gap", "BOOLEAN"), ("is_implausible", "BOOLEAN"),
    ("prompt_tokens", "DOUBLE"), ("output_tokens", "DOUBLE"), ("is_rapl_ambiguous", "BOOLEAN"),
    ("is_busy", "BOOLEAN"), ("is_window_measured", "BOOLEAN"), ("start_worker_id", "VARCHAR"),
    ("start_session_id", "VARCHAR"), ("end_worker_id", "VARCHAR"), ("end_session_id", "VARCHAR"),
    ("weight", "DOUBLE"), ("interval_energy_j", "DOUBLE"),
)
_ATTRIBUTION_COLUMNS = (
    ("worker_id", "VARCHAR"), ("session_id", "VARCHAR"), ("device_id", "VARCHAR"), ("end_seq", "BIGINT"),
    ("start_ts", "TIMESTAMPTZ"), ("end_ts", "TIMESTAMPTZ"), ("model_id", "VARCHAR"), ("method", "VARCHAR"),
    ("request_id", "VARCHAR"), ("energy_j", "DOUBLE"), ("prompt_tokens", "DOUBLE"), ("output_tokens", "DOUBLE"),
    ("is_window_measured", "BOOLEAN"), ("end_worker_id", "VARCHAR"), ("end_session_id", "VARCHAR"),
)
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


class QueryRejected(ValueError):
    """The SQL is not exactly one read-only SELECT statement (or is too long)."""


class QueryFailed(RuntimeError):
    """DuckDB refused or failed the query (including: reading a file, which is disabled)."""


@dataclass(frozen=True)
class PriceBookEntry:
    """List price in $ per 1M tokens: what the tokens would have cost from a paid API."""

    prompt_usd_per_m: float
    cached_usd_per_m: float
    output_usd_per_m: float


@dataclass(frozen=True)
class EnergyIngest:
    num_new: int
    num_duplicates: int


jsonable = sql_values.json_value
"""A value DuckDB returned, as JSON has it (sql_values.py: the one serialiser of both SQL answers)."""


PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700


def make_private(*paths: Path) -> None:
    """chmod each existing file to 0600 unless it is already (files other users could read: docs/deploy.md)."""
    for path in paths:
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
            if mode != PRIVATE_FILE_MODE:
                os.chmod(path, PRIVATE_FILE_MODE)
        except FileNotFoundError:
            continue


def _connect(path: Path, read_only: bool) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(str(path), read_only=read_only, config={"enable_external_access": False})
    con.execute("SET TimeZone = 'UTC'")
    return con


def _ts(epoch_s: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(epoch_s, dt.UTC)


def _ts_us(us: int) -> dt.datetime:
    """A sample's or interval's time from its whole microseconds: exactly what TIMESTAMPTZ stores, so the
    intervals' durations (integer µs differences) are those of the stored values."""
    return _EPOCH + dt.timedelta(microseconds=us)


def _hour_start(t: dt.datetime) -> dt.datetime:
    return t.replace(minute=0, second=0, microsecond=0)


def _raw_cutoff(now_s: float, retention_days: float) -> dt.datetime:
    """Hours starting from this one are recomputed from raw rows; older ones only from their rollups (the
    retention may have deleted some of their raw rows)."""
    return _ts(now_s - retention_days * 86400 + HOUR_S)


def _one(cursor: duckdb.DuckDBPyConnection) -> tuple[Any, ...]:
    """The one row of an aggregate without GROUP BY."""
    row = cursor.fetchone()
    assert row is not None  # an aggregate without GROUP BY always has one row
    return row


def _hours(start_s: float, end_s: float) -> list[float]:
    """The UTC hour starts (epoch s) that an interval touches."""
    lo = math.floor(min(start_s, end_s) / HOUR_S) * HOUR_S
    hi = math.floor(max(start_s, end_s) / HOUR_S) * HOUR_S
    return [float(h) for h in range(int(lo), int(hi) + 1, HOUR_S)]


class Ledger:
    """Synchronous DuckDB access. The writer methods belong to one thread, :meth:`query` to another."""

    def __init__(self, path: Path, read_only: bool = False, limits: Limits | None = None,
                 num_query_cursors: int = 1) -> None:
        self.path = path
        self.limits = limits or Limits()
        self.is_read_only = read_only
        if not read_only:
            if not path.parent.exists():
                path.parent.mkdir(parents=True, mode=PRIVATE_DIR_MODE)
            self.secure_files()  # an existing file from before this rule
        self.con = _connect(path, read_only)
        if not read_only:
            self.secure_files()
        if not read_only:
            self.con.execute(schema.TABLES)
            self.con.execute(schema.MIGRATIONS)
            self._migrate_columns()
            self._migrate_device_streams()
            self.con.execute(schema.VIEWS)
        self.reader = self.con.cursor()
        self.reader.execute("SET TimeZone = 'UTC'")
        self.query_cursors = [self.con.cursor() for _ in range(num_query_cursors)]
        for cursor in self.query_cursors:
            cursor.execute("SET TimeZone = 'UTC'")
        self.guard = QueryGuard.of(self.con)
        # From here on no connection can change a setting: external access stays off.
        self.con.execute("SET lock_configuration = true")

    def close(self) -> None:
        for cursor in self.query_cursors:
            cursor.close()
        self.reader.close()
        self.con.close()

    def secure_files(self) -> None:
        """The database file and its WAL: 0600 (call after writes: a checkpoint removes the WAL, the next
        write creates a new one)."""
        if not self.is_read_only:
            make_private(self.path, self.path.with_name(self.path.name + ".wal"))

    def check(self, cursor: duckdb.DuckDBPyConnection, sql: str, max_sql_chars: int = 20_000) -> None:
        """:func:`check_query` with this database's function rule."""
        check_query(cursor, sql, max_sql_chars, self.guard)

    def _migrate_columns(self) -> None:
        """Run each ``schema.COLUMN_MIGRATIONS`` step whose column is missing, one transaction per step."""
        for table, column, statements in schema.COLUMN_MIGRATIONS:
            present = self.con.execute("SELECT count(*) FROM information_schema.columns WHERE table_name = ? "
                                       "AND column_name = ?", [table, column]).fetchone()
            if present == (0,):
                self._transaction(lambda: self.con.execute(statements))  # runs here, before the loop moves on

    # ---- configuration rows ---------------------------------------------------------------------------

    def set_tariff(self, usd_per_kwh: float, now_s: float, source: str) -> None:
        """Record the configured rate (``--electricity-rate``, the gateway's config), effective now, unless
        it is the configured rate already recorded.

        Compared with the last *configured* rate, not the rate in force: dated rates
        (:meth:`add_dated_rate`) stay in force until the configured rate itself changes. The first rate
        recorded also covers everything before it, so old energy gets a price."""
        last = self.con.execute("SELECT usd_per_kwh FROM tariff WHERE source <> ? ORDER BY effective_from DESC "
                                "LIMIT 1", [DATED_RATE_SOURCE]).fetchone()
        if last is not None and last[0] == usd_per_kwh:
            return
        is_empty = self.con.execute("SELECT count(*) = 0 FROM tariff").fetchone() == (True,)
        effective = dt.datetime(1970, 1, 1, tzinfo=dt.UTC) if is_empty else _ts(now_s)
        self.con.execute("INSERT OR REPLACE INTO tariff VALUES (?, ?, ?)", [effective, usd_per_kwh, source])

    def add_dated_rate(self, effective_s: float, usd_per_kwh: float) -> bool:
        """Record a rate in force from ``effective_s`` (until the next rate), replacing one that starts at
        the same moment, and mark every rolled-up hour from then on dirty, so the next refresh prices it
        again. Returns False (and changes nothing) when exactly that rate is already recorded.

        An hour is priced at the rate in force at its start. Hours older than the raw-data retention are
        re-priced in place by the refresh (:meth:`refresh_rollups`), so a rate may reach back any time."""
        effective = _ts(effective_s)

        def work() -> bool:
            row = self.con.execute("SELECT usd_per_kwh, source FROM tariff WHERE effective_from = ?",
                                   [effective]).fetchone()
            if row == (usd_per_kwh, DATED_RATE_SOURCE):
                return False
            self.con.execute("INSERT OR REPLACE INTO tariff VALUES (?, ?, ?)",
                             [effective, usd_per_kwh, DATED_RATE_SOURCE])
            # Hours not rolled up yet are dirty already; these are the ones priced at the old rate.
            self.con.execute("INSERT OR IGNORE INTO rollup_dirty SELECT DISTINCT hour FROM energy_hourly "
                             "WHERE hour >= $1 UNION SELECT DISTINCT hour FROM key_energy_hourly WHERE hour >= $1",
                             [_hour_start(effective)])
            return True

        return self._transaction(work)

    def rate_at(self, now_s: float) -> float | None:
        """The rate in force at ``now_s`` ($/kWh), None before the first."""
        row = self.con.execute("SELECT usd_per_kwh FROM tariff WHERE effective_from <= ? ORDER BY effective_from "
                               "DESC LIMIT 1", [_ts(now_s)]).fetchone()
        return None if row is None else float(row[0])

    def set_price_book(self, entries: dict[str, PriceBookEntry], replace: bool = False) -> None:
        """Upsert list prices; ``replace``: the given book is the whole book (a model not in it loses its price)."""
        self.con.execute("BEGIN")
        if replace:
            self.con.execute("DELETE FROM price_book")
        for model_id, e in entries.items():
            self.con.execute("INSERT OR REPLACE INTO price_book VALUES (?, ?, ?, ?, now())",
                             [model_id, e.prompt_usd_per_m, e.cached_usd_per_m, e.output_usd_per_m])
        self.con.execute("COMMIT")

    # ---- ingest -----------------------------------------------------------------------------------------

    def _insert(self, table: str, columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[Any]],
                returning: str = "") -> list[tuple[Any, ...]]:
        """Insert rows column-wise (one list parameter per column: ~100x faster than executemany);
        a primary key already present is skipped. Returns the RETURNING rows or the inserted count."""
        if not rows:
            return []
        names = ", ".join(name for name, _ in columns)
        selects = ", ".join(f"unnest(${i + 1}::{kind}[])" for i, (_, kind) in enumerate(columns))
        params = [list(col) for col in zip(*rows, strict=True)]
        sql = f"INSERT OR IGNORE INTO {table} ({names}) SELECT * FROM (SELECT {selects})"
        return self.con.execute(sql + (f" RETURNING {returning}" if returning else ""), params).fetchall()

    def _transaction(self, fn: Callable[[], T]) -> T:
        self.con.execute("BEGIN")
        try:
            result = fn()
            self.con.execute("COMMIT")
        except BaseException:
            self.con.execute("ROLLBACK")
            raise
        return result

    def insert_usage(self, records: Sequence[UsageRecord]) -> int:
        """Insert in one transaction; a request id already present is skipped. Returns rows added."""
        if not records:
            return 0

        def work() -> int:
            rows = [(r.request_id, _ts(r.ts_s), r.gateway_id, r.session_id, r.seq, r.model, r.pool, r.member,
                     r.worker_id, r.api_key_id, r.endpoint, r.stream, r.status, r.http_status, r.finish_reason,
                     r.error_code, r.prompt_tokens, r.cached_tokens, r.output_tokens, r.ttft_ms, r.latency_ms,
                     r.routing_reason, r.usage_source, r.limit_kind, r.user_id) for r in records]
            added = self._insert("requests", _USAGE_COLUMNS, rows, returning="request_id")
            new_ids = {a[0] for a in added}
            # The request ran from ts - latency to ts: its energy shares lie in those hours, and in the hour
            # after when its last tokens went out in a sample after ts (the next one, at most max_gap_s
            # later unless samples were lost). Without it that hour's rollup, refreshed before the record
            # came, keeps the share without its API key.
            dirty: set[float] = set()
            for r in records:
                if r.request_id in new_ids:
                    dirty.update(_hours(r.ts_s - max(r.latency_ms, 0.0) / 1000, r.ts_s + self.limits.max_gap_s))
            self._mark_dirty(dirty)
            return len(new_ids)

        return self._transaction(work)

    def _mark_dirty(self, hours: Iterable[float]) -> None:
        items = sorted(set(hours))
        if items:
            self.con.execute("INSERT OR IGNORE INTO rollup_dirty SELECT to_timestamp(unnest($1::DOUBLE[]))",
                             [items])

    def park(self, stream: str, subject: str, stream_seq: int | None, reason: str, payload: bytes) -> None:
        """Keep an undecodable message with the reason, so an operator can see what was dropped."""
        self.con.execute("INSERT INTO parked (stream, subject, stream_seq, reason, payload) VALUES (?, ?, ?, ?, ?)",
                         [stream, subject, stream_seq, reason, payload])

    def insert_energy(self, batch: Sequence[EnergySample]) -> EnergyIngest:
        """Store new samples and re-derive the intervals around them, in one transaction.

        A sample is identified by ``(worker_id, session_id, seq)``: one already stored is a duplicate and
        changes nothing. The device-stream intervals the new samples can change are deleted and derived
        again (:meth:`_rederive`), so a late (out-of-order) reading splits the interval that spanned it and
        the tokens around it are spread again. The hours those intervals touch are marked for the refresh.
        """
        unique = {(s.worker_id, s.session_id, s.seq): s for s in batch}
        return self._transaction(lambda: self._insert_energy(list(unique.values()), len(batch)))

    def _insert_energy(self, samples: list[EnergySample], num_received: int) -> EnergyIngest:
        new_keys = {tuple(k) for k in self._insert(
            "sample_log",
            (("worker_id", "VARCHAR"), ("session_id", "VARCHAR"), ("seq", "BIGINT"), ("ts", "TIMESTAMPTZ"),
             ("model_id", "VARCHAR")),
            [(s.worker_id, s.session_id, s.seq, _ts_us(epoch_us(s.ts_s)), s.model_id) for s in samples],
            returning="worker_id, session_id, seq")}
        new = [s for s in samples if (s.worker_id, s.session_id, s.seq) in new_keys]
        self._insert("energy_samples", (
            ("worker_id", "VARCHAR"), ("session_id", "VARCHAR"), ("seq", "BIGINT"), ("device_id", "VARCHAR"),
            ("ts", "TIMESTAMPTZ"), ("kind", "VARCHAR"), ("method", "VARCHAR"), ("energy_mj", "BIGINT"),
            ("max_range_mj", "BIGINT"), ("power_mw", "BIGINT"), ("energy_uj", "BIGINT"), ("max_range_uj", "BIGINT")),
            [(s.worker_id, s.session_id, s.seq, r.device_id, _ts_us(epoch_us(s.ts_s)), r.kind, r.method, r.energy_mj,
              r.max_range_mj, r.power_mw, r.energy_uj, r.max_range_uj) for s in new for r in s.readings])
        self._insert("sample_tokens", (
            ("worker_id", "VARCHAR"), ("session_id", "VARCHAR"), ("seq", "BIGINT"), ("request_id", "VARCHAR"),
            ("prompt_tokens", "BIGINT"), ("output_tokens", "BIGINT")),
            [(s.worker_id, s.session_id, s.seq, t.request_id, t.prompt_tokens, t.output_tokens)
             for s in new for t in s.request_tokens])
        dirty: set[float] = set()
        if new:
            self._rederive([sample_of(s) for s in new], [(s.worker_id, s.session_id) for s in new], dirty)
        self._mark_dirty(dirty)
        return EnergyIngest(num_new=len(new), num_duplicates=num_received - len(new))

    # ---- device streams (device_stream.py; docs/accounting.md, "Intervals") ----------------------------

    def _rederive(self, new: list[Sample], identities: list[tuple[str, str]], dirty: set[float]) -> None:
        """Derive again every device interval the new samples can change, and write its parts and shares.

        The span: from the session-previous sample of each new one to its session-next one ([t0, t1]: the new
        readings and every token window they change). Per device reporting in it, the target is the intervals
        ending in (a_d, b_d], a_d the device's last reading before t0 and b_d its first after t1 (the interval
        spanning a new reading, and those its windows overlap). They are derived from every sample within
        ``max_gap_s`` of the targets (the token windows that reach into them), and each session's sample
        before those, for its first window."""
        t0, t1 = self._session_span(new, identities)
        margin_us = round(self.limits.max_gap_s * US_PER_S)
        anchors = self._device_anchors(t0, t1, margin_us)
        if not anchors:
            return
        lo = min(a for a, _ in anchors.values())
        hi = max(b for _, b in anchors.values())
        samples = self._load_stream(lo - margin_us, hi + margin_us)
        previous = self._previous_samples(samples)
        for device_id, (a_us, b_us) in anchors.items():
            for start_s, end_s in self.con.execute(
                    "DELETE FROM energy_intervals WHERE device_id = ? AND end_ts > ? AND end_ts <= ? "
                    "RETURNING epoch(start_ts), epoch(end_ts)", [device_id, _ts_us(a_us), _ts_us(b_us)]).fetchall():
                dirty.update(_hours(start_s, end_s))
            self.con.execute("DELETE FROM energy_attribution WHERE device_id = ? AND end_ts > ? AND end_ts <= ?",
                             [device_id, _ts_us(a_us), _ts_us(b_us)])
        parts = [p for p in split(samples, self.limits, previous)
                 if p.device.interval.device_id in anchors
                 and anchors[p.device.interval.device_id][0] < p.device.interval.end_us
                 <= anchors[p.device.interval.device_id][1]]
        self._write_parts(parts, dirty)

    def _write_parts(self, parts: Sequence[Part], dirty: set[float]) -> None:
        rows: list[tuple[Any, ...]] = []
        shares: list[tuple[Any, ...]] = []
        for p in parts:
            iv, d = p.interval, p.device
            dirty.update(_hours(iv.start_s, iv.end_s))
            rows.append((p.worker_id, p.session_id, iv.device_id, iv.start_seq, iv.end_seq, _ts_us(iv.start_us),
                         _ts_us(iv.end_us), p.model_id, iv.kind, iv.method, iv.energy_j, p.device_s, iv.is_reset,
                         iv.is_wrap, iv.is_gap, iv.is_implausible, iv.prompt_tokens, iv.output_tokens,
                         iv.is_rapl_ambiguous, iv.is_busy, iv.is_window_measured, d.start.worker_id,
                         d.start.session_id, d.end.worker_id, d.end.session_id, p.weight, d.interval.energy_j))
            shares.extend((p.worker_id, p.session_id, iv.device_id, iv.end_seq, _ts_us(iv.start_us), _ts_us(iv.end_us),
                           p.model_id, iv.method, sh.request_id, sh.energy_j, sh.prompt_tokens, sh.output_tokens,
                           iv.is_window_measured, d.end.worker_id, d.end.session_id) for sh in p.shares)
        self._insert("energy_intervals", _INTERVAL_COLUMNS, rows)
        # energy_attribution has no key (idle shares have no request id): plain insert.
        if shares:
            names = ", ".join(n for n, _ in _ATTRIBUTION_COLUMNS)
            selects = ", ".join(f"unnest(${i + 1}::{k}[])" for i, (_, k) in enumerate(_ATTRIBUTION_COLUMNS))
            self.con.execute(f"INSERT INTO energy_attribution ({names}) SELECT * FROM (SELECT {selects})",
                             [list(c) for c in zip(*shares, strict=True)])

    def _session_span(self, new: list[Sample], identities: list[tuple[str, str]]) -> tuple[int, int]:
        """[t0, t1] µs: the new samples with their sessions' previous and next stored samples."""
        by_session: dict[tuple[str, str], list[int]] = defaultdict(list)
        for s, key in zip(new, identities, strict=True):
            by_session[key].append(s.seq)
        t0 = min(s.ts_us for s in new)
        t1 = max(s.ts_us for s in new)
        for (worker_id, session_id), seqs in by_session.items():
            row = _one(self.con.execute(
                "SELECT (SELECT epoch_us(ts) FROM sample_log WHERE worker_id = $1 AND session_id = $2 AND seq < $3 "
                "ORDER BY seq DESC LIMIT 1), (SELECT epoch_us(ts) FROM sample_log WHERE worker_id = $1 AND "
                "session_id = $2 AND seq > $4 ORDER BY seq LIMIT 1)", [worker_id, session_id, min(seqs), max(seqs)]))
            t0 = min(t0, row[0] if row[0] is not None else t0)
            t1 = max(t1, row[1] if row[1] is not None else t1)
        return t0, t1

    def _device_anchors(self, t0: int, t1: int, margin_us: int) -> dict[str, tuple[int, int]]:
        """Per device with a reading in [t0, t1]: (a_d, b_d) µs, its last reading before t0 (t0 - 1 when none)
        and its first after t1 (t1 when none). The look-back widens from 2 x max_gap_s to the whole history
        only for a device silent that long, so an ingest reads the recent rows, not a device's history."""
        devices = [r[0] for r in self.con.execute(
            "SELECT DISTINCT device_id FROM energy_samples WHERE ts BETWEEN ? AND ?",
            [_ts_us(t0), _ts_us(t1)]).fetchall()]
        if not devices:
            return {}
        after = dict(self.con.execute(
            "SELECT device_id, min(epoch_us(ts)) FROM energy_samples WHERE device_id IN (SELECT unnest($1::VARCHAR[])) "
            "AND ts > $2 GROUP BY ALL", [devices, _ts_us(t1)]).fetchall())
        before: dict[str, int] = {}
        for lookback_us in (2 * margin_us, 86400 * US_PER_S, None):
            missing = [d for d in devices if d not in before]
            if not missing:
                break
            since = _ts_us(t0 - lookback_us) if lookback_us is not None else _EPOCH
            before.update(self.con.execute(
                "SELECT device_id, max(epoch_us(ts)) FROM energy_samples WHERE device_id IN "
                "(SELECT unnest($1::VARCHAR[])) AND ts < $2 AND ts >= $3 GROUP BY ALL",
                [missing, _ts_us(t0), since]).fetchall())
        return {d: (before.get(d, t0 - 1), after.get(d, t1)) for d in devices}

    def _load_stream(self, lo_us: int, hi_us: int) -> list[StreamSample]:
        """Every stored sample (any worker, session or device) with its time in [lo_us, hi_us]."""
        span = [_ts_us(lo_us), _ts_us(hi_us)]
        return self._load_samples("ts BETWEEN $1 AND $2", span)

    def _previous_samples(self, samples: Sequence[StreamSample]) -> dict[tuple[str, str], StreamSample]:
        """Each session's stored sample before its first in ``samples`` (its first window starts there)."""
        first: dict[tuple[str, str], int] = {}
        for s in samples:
            key = (s.worker_id, s.session_id)
            first[key] = min(first.get(key, s.sample.seq), s.sample.seq)
        out: dict[tuple[str, str], StreamSample] = {}
        for (worker_id, session_id), seq in first.items():
            row = self.con.execute("SELECT max(seq) FROM sample_log WHERE worker_id = ? AND session_id = ? AND seq < ?",
                                   [worker_id, session_id, seq]).fetchone()
            if row and row[0] is not None:
                (prev,) = self._load_samples("worker_id = $1 AND session_id = $2 AND seq = $3",
                                             [worker_id, session_id, row[0]])
                out[(worker_id, session_id)] = prev
        return out

    def _load_samples(self, where: str, args: list[Any]) -> list[StreamSample]:
        heads = self.con.execute(f"SELECT worker_id, session_id, seq, epoch_us(ts), model_id FROM sample_log "
                                 f"WHERE {where}", args).fetchall()
        readings: dict[tuple[str, str, int], dict[str, Reading]] = defaultdict(dict)
        for (worker_id, session_id, seq, device_id, kind, method, energy_mj, max_range_mj, energy_uj,
             max_range_uj) in self.con.execute(
                f"SELECT worker_id, session_id, seq, device_id, kind, method, energy_mj, max_range_mj, energy_uj, "
                f"max_range_uj FROM energy_samples WHERE {where}", args).fetchall():
            readings[(worker_id, session_id, seq)][device_id] = Reading(
                device_id=device_id, kind=kind, method=method, energy_mj=energy_mj, max_range_mj=max_range_mj,
                energy_uj=energy_uj, max_range_uj=max_range_uj)
        tokens: dict[tuple[str, str, int], list[TokenCount]] = defaultdict(list)
        for worker_id, session_id, seq, request_id, prompt, output in self.con.execute(
                "SELECT t.worker_id, t.session_id, t.seq, t.request_id, t.prompt_tokens, t.output_tokens "
                f"FROM sample_tokens t JOIN (SELECT worker_id, session_id, seq FROM sample_log WHERE {where}) s "
                "USING (worker_id, session_id, seq)", args).fetchall():
            tokens[(worker_id, session_id, seq)].append(
                TokenCount(request_id=request_id, prompt_tokens=prompt, output_tokens=output))
        return [StreamSample(worker_id=w, session_id=sess, sample=Sample(
                    seq=seq, ts_us=ts_us, model_id=model_id, readings=readings.get((w, sess, seq), {}),
                    tokens=tokens.get((w, sess, seq), []))) for w, sess, seq, ts_us, model_id in heads]

    def _migrate_device_streams(self) -> None:
        """A ledger whose intervals were per worker session (no ``end_worker_id``): drop the derived
        intervals and shares, derive them again from the stored samples as device streams, and mark every
        hour they touch (old and new) dirty. One transaction; a one-off cost of about one ingest of every
        stored sample (a day's rows in memory at a time)."""
        present = self.con.execute("SELECT count(*) FROM information_schema.columns WHERE table_name = "
                                   "'energy_intervals' AND column_name = 'end_worker_id'").fetchone()
        if present != (0,):
            return

        def work() -> None:
            dirty: set[float] = set()
            for start_s, end_s in self.con.execute("SELECT epoch(start_ts), epoch(end_ts) FROM energy_intervals"
                                                   ).fetchall():
                dirty.update(_hours(start_s, end_s))
            self.con.execute("DROP TABLE energy_intervals")
            self.con.execute("DROP TABLE energy_attribution")
            self.con.execute(schema.TABLES)
            # A day of samples at a time, as if they arrived then (each day's neighbourhood derived again),
            # so memory holds a day's rows, not the whole retention.
            lo, hi = _one(self.con.execute("SELECT epoch_us(min(ts)), epoch_us(max(ts)) FROM sample_log"))
            day_us = 86400 * US_PER_S
            for start_us in range(lo, hi + 1, day_us) if lo is not None else ():
                chunk = self._load_samples("ts >= $1 AND ts < $2", [_ts_us(start_us), _ts_us(start_us + day_us)])
                if chunk:
                    self._rederive([c.sample for c in chunk], [(c.worker_id, c.session_id) for c in chunk], dirty)
            self._mark_dirty(dirty)

        self._transaction(work)

    # ---- rollups, retention, export ---------------------------------------------------------------------

    def refresh_rollups(self, now_s: float, retention_days: float) -> int:
        """Recompute the hourly and daily rollups of every hour marked dirty; returns hours refreshed.

        Hours older than the raw-data retention are not recomputed (their raw rows may be gone); their
        hourly rollups are only priced again at the tariff in force (a dated rate entered later), from
        the joules they keep, and their days summed again."""
        cutoff = _raw_cutoff(now_s, retention_days)

        def work() -> int:
            self.con.execute("CREATE OR REPLACE TEMP TABLE dirty_now AS SELECT hour FROM rollup_dirty WHERE hour >= ?",
                             [cutoff])
            self.con.execute("CREATE OR REPLACE TEMP TABLE dirty_old AS SELECT hour FROM rollup_dirty WHERE hour < ?",
                             [cutoff])
            self.con.execute("DELETE FROM rollup_dirty")
            row = self.con.execute("SELECT count(*), min(hour), max(hour) + INTERVAL 1 HOUR, "
                                   "(SELECT count(*) FROM dirty_old) FROM dirty_now").fetchone()
            assert row is not None
            num, lo, hi, num_old = row
            if num:
                for table in ("energy_hourly", "key_energy_hourly", "usage_hourly"):
                    self.con.execute(f"DELETE FROM {table} WHERE hour IN (SELECT hour FROM dirty_now)")
                for sql in (schema.REFRESH_ENERGY_HOURLY, schema.REFRESH_KEY_ENERGY_HOURLY,
                            schema.REFRESH_USAGE_HOURLY):
                    self.con.execute(sql, [lo, hi])
            if num_old:
                for sql in schema.REPRICE_HOURLY:
                    self.con.execute(sql)
            if num or num_old:
                self.con.execute("CREATE OR REPLACE TEMP TABLE dirty_days AS SELECT DISTINCT hour::DATE AS day "
                                 "FROM (SELECT hour FROM dirty_now UNION ALL SELECT hour FROM dirty_old)")
                for table, sql in schema.REFRESH_DAILY.items():
                    self.con.execute(f"DELETE FROM {table} WHERE day IN (SELECT day FROM dirty_days)")
                    self.con.execute(sql)
            return int(num + num_old)

        return self._transaction(work)

    def enforce_retention(self, now_s: float, retention_days: float) -> int:
        """Delete raw energy rows older than the retention (rollups stay forever), then checkpoint so
        the file gives the space back. Returns raw sample rows deleted."""
        cutoff = _ts(now_s - retention_days * 86400)

        def work() -> int:
            deleted = 0
            for table, column in (("energy_attribution", "end_ts"), ("energy_intervals", "end_ts"),
                                  ("energy_samples", "ts")):
                row = self.con.execute(f"DELETE FROM {table} WHERE {column} < ?", [cutoff]).fetchone()
                if table == "energy_samples" and row:
                    deleted = int(row[0])
            for table in ("sample_tokens",):
                self.con.execute(f"DELETE FROM {table} t USING sample_log s WHERE s.ts < ? AND s.worker_id = "
                                 "t.worker_id AND s.session_id = t.session_id AND s.seq = t.seq", [cutoff])
            self.con.execute("DELETE FROM sample_log WHERE ts < ?", [cutoff])
            self.con.execute("DELETE FROM rollup_dirty WHERE hour < ?", [cutoff])
            return deleted

        deleted = self._transaction(work)
        self.con.execute("CHECKPOINT")
        return deleted

    def export_parquet(self, directory: Path) -> list[Path]:
        """Write every rollup table to ``directory/<table>.parquet`` (temp file + rename).

        The ledger's own database may not touch files, so the rows go through a separate in-memory
        DuckDB that may."""
        directory.mkdir(parents=True, exist_ok=True)
        out = duckdb.connect(":memory:")
        written = []
        try:
            out.execute("SET TimeZone = 'UTC'")
            for table in schema.ROLLUP_TABLES:
                columns = [(r[0], r[1]) for r in self.con.execute(f"DESCRIBE {table}").fetchall()]
                out.execute(f"CREATE TABLE {table} ({', '.join(f'{n} {k}' for n, k in columns)})")
                rows = self.con.execute(f"SELECT * FROM {table}").fetchall()
                if rows:
                    selects = ", ".join(f"unnest(${i + 1}::{k}[])" for i, (_, k) in enumerate(columns))
                    out.execute(f"INSERT INTO {table} SELECT * FROM (SELECT {selects})",
                                [list(c) for c in zip(*rows, strict=True)])
                final = directory / f"{table}.parquet"
                tmp = directory / f".{table}.parquet.tmp"
                out.execute(f"COPY {table} TO '{tmp}' (FORMAT parquet)")
                os.replace(tmp, final)
                written.append(final)
        finally:
            out.close()
        return written

    # ---- key energy (the gateway's kWh-per-month limit) -----------------------------------------------------

    def key_energy(self, start_s: float, end_s: float, now_s: float, retention_days: float
                   ) -> tuple[dict[str, float], float | None]:
        """Measured joules attributed to each API key's requests in [``start_s``, ``end_s``) (UTC midnights:
        a month), and the newest interval end (epoch s, at most ``end_s``) the figure covers,
        None when there is none. Read-only; call on the writer thread, which sees every committed batch.

        The figure is what ``key_energy_daily.busy_j`` sums to after the next refresh (an interval across
        the month's start or end split in proportion to time), without waiting for it: current days and
        hours come from the rollups, dirty hours from the raw shares (schema.KEY_ENERGY_OF_*). Only shares
        with energy from a measured method count (no idle, no ``estimated``, no unknown energy), and only
        once the request's usage record is stored: a share whose request row has not arrived yet (records
        are sent when a request ends) belongs to no key, so a long request's energy counts from its end on.

        Why not raw shares alone: a month is longer than the default 30-day retention of raw rows (and an
        operator may keep less), while the rollups are kept. Why not refresh and read the rollups: the
        refresh writes, and joins every request ever stored. Measured on a ledger of 30M requests and a
        month of 3M shares and 1.4M key-hour rows, 2 cores: the month from the raw shares alone took 1.1 s
        (3.8 s without the time bound on ``requests``); this way 12 ms, or 80 ms with two hours dirty."""
        start, end = _ts(start_s), _ts(end_s)
        raw_from = max(start, _raw_cutoff(now_s, retention_days))
        lo, hi, lo_day, hi_day = _one(self.con.execute(
            "SELECT min(hour), max(hour) + INTERVAL 1 HOUR, date_trunc('day', min(hour)), "
            "date_trunc('day', max(hour)) + INTERVAL 1 DAY FROM rollup_dirty WHERE hour >= ? AND hour < ?",
            [raw_from, end]))
        joules: dict[str, float] = defaultdict(float)
        for key, j in self.con.execute(schema.KEY_ENERGY_OF_CURRENT_HOURS, [
                start, end, lo_day or start, hi_day or start, raw_from]).fetchall():
            joules[key] += j
        if lo is not None:
            # A request owning a share of (start_ts, end_ts] made tokens then, so it ended after start_ts.
            (oldest,) = _one(self.con.execute("SELECT min(start_ts) FROM energy_attribution WHERE end_ts >= ? "
                                              "AND start_ts < ? AND request_id IS NOT NULL", [lo, hi]))
            if oldest is not None:
                for key, j in self.con.execute(schema.KEY_ENERGY_OF_DIRTY_HOURS,
                                               [lo, hi, oldest - CLOCK_SKEW]).fetchall():
                    joules[key] += j
        (as_of,) = _one(self.con.execute("SELECT epoch(max(end_ts)) FROM energy_attribution "
                                         "WHERE end_ts >= $1 AND start_ts < $2", [start, end]))
        if as_of is None:  # the raw rows are gone (older than the retention): as far as the rollup goes
            (as_of,) = _one(self.con.execute("SELECT epoch(max(hour) + INTERVAL 1 HOUR) FROM key_energy_hourly "
                                             "WHERE hour >= $1 AND hour < $2", [start, end]))
        return dict(joules), None if as_of is None else min(float(as_of), end_s)

    # ---- costs --------------------------------------------------------------------------------------------

    def costs(self, now_s: float, num_days: int) -> CostsReport:
        """The costs document (services/accounting/costs.py) over the ``num_days`` UTC days ending today."""
        now = _ts(now_s)
        start = now.date() - dt.timedelta(days=num_days - 1)

        def usage(group: str) -> dict[Any, costs.UsageTotals]:
            rows = self.con.execute(
                f"SELECT {group}, sum(num_requests), sum(prompt_tokens), sum(cached_tokens), sum(output_tokens), "
                f"sum(list_value_usd) FROM daily_usage WHERE day >= ? GROUP BY ALL", [start]).fetchall()
            return {r[0]: costs.UsageTotals(num_requests=int(r[1]), prompt_tokens=int(r[2]),
                                            cached_tokens=int(r[3]), output_tokens=int(r[4]), list_value_usd=r[5])
                    for r in rows}

        def energy(group: str) -> dict[Any, costs.EnergyTotals]:
            rows = self.con.execute(
                f"SELECT {group}, sum(measured_j), sum(energy_usd), sum(estimated_j), sum(jpt_busy_j), "
                f"coalesce(sum(busy_output_tokens), 0), sum(covered_s), sum(device_s), list(DISTINCT method) "
                f"FROM energy_daily WHERE day >= ? GROUP BY ALL", [start]).fetchall()
            return {r[0]: costs.EnergyTotals(measured_j=r[1], energy_usd=r[2], estimated_j=r[3], jpt_busy_j=r[4],
                                             busy_output_tokens=r[5], covered_s=r[6], device_s=r[7],
                                             methods=tuple(r[8])) for r in rows}

        # Per key: busy energy only, its methods from the intervals attributed to the key's requests, and
        # coverage over output tokens (device-time is shared between keys; tokens are what it is split by).
        key_rows = self.con.execute(
            "SELECT api_key_id, sum(busy_j), sum(energy_usd), sum(estimated_j), "
            "coalesce(sum(measured_output_tokens), 0), coalesce(sum(output_tokens), 0), "
            "list(DISTINCT method) FILTER (method IS NOT NULL), sum(jpt_busy_j) "
            "FROM key_energy_daily WHERE day >= ? GROUP BY ALL", [start]).fetchall()
        key_energy = {r[0]: costs.EnergyTotals(measured_j=r[1], energy_usd=r[2], estimated_j=r[3], jpt_busy_j=r[7],
                                               busy_output_tokens=r[4], attributed_output_tokens=r[5],
                                               methods=tuple(r[6] or ())) for r in key_rows}
        return costs.build_costs(
            now=now, num_days=num_days, rate_usd_per_kwh=self.rate_at(now_s),
            daily_usage=usage("day"), daily_energy=energy("day"),
            by_model=(usage("model"), energy("model_id")), by_member=(usage("worker_id"), energy("worker_id")),
            by_api_key=(usage("api_key_id"), key_energy))

    # ---- operator SQL -----------------------------------------------------------------------------------

    def query(self, sql: str, max_rows: int = 10_000, max_sql_chars: int = 20_000
              ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run exactly one SELECT (or WITH … SELECT) on the reader connection, in a read-only transaction.

        Refused before it runs: more than ``max_sql_chars``, anything that does not parse, more than one
        statement, any statement type but SELECT, a function sql_guard.py refuses. What a SELECT could
        still try (a data-modifying CTE, a file reader such as ``read_csv``) fails inside: the transaction
        is read-only and the database has no external access. Call from one thread at a time;
        :meth:`interrupt` may come from any thread. Raw DuckDB values and no result cap: for in-process
        callers (tests, benchmarks); operators' queries go through sql_runner.py.
        """
        self.check(self.reader, sql, max_sql_chars)
        cur = self.reader
        try:
            cur.execute("BEGIN TRANSACTION READ ONLY")
            try:
                cur.execute(sql)
                columns = [d[0] for d in cur.description or []]
                rows = cur.fetchmany(max_rows)
            finally:
                cur.execute("ROLLBACK")
        except duckdb.Error as exc:
            raise QueryFailed(str(exc).split("\n\nLINE", 1)[0]) from None
        return columns, rows

    def interrupt(self) -> None:
        self.reader.interrupt()


@dataclass(frozen=True)
class QueryGuard:
    """This DuckDB's function names for sql_guard.py, read once from ``duckdb_functions()``."""

    table_functions: frozenset[str]
    denied: frozenset[str]

    @classmethod
    def of(cls, con: duckdb.DuckDBPyConnection) -> QueryGuard:
        rows = con.execute("SELECT DISTINCT lower(function_name), function_type, has_side_effects "
                           "FROM duckdb_functions()").fetchall()
        tables = frozenset(n for n, kind, _ in rows if kind in ("table", "table_macro"))
        side_effects = frozenset(n for n, kind, effects in rows if effects and kind not in ("table", "table_macro"))
        return cls(table_functions=tables, denied=sql_guard.denied_functions(side_effects))


def check_query(con: duckdb.DuckDBPyConnection, sql: str, max_sql_chars: int,
                guard: QueryGuard | None = None) -> None:
    """Raise :class:`QueryRejected` unless ``sql`` is one SELECT statement of at most ``max_sql_chars``
    calling only functions the guard allows (sql_guard.py; ``guard`` None: read from ``con``)."""
    if len(sql) > max_sql_chars:
        raise QueryRejected(f"query is {len(sql)} characters; the limit is {max_sql_chars}")
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise QueryRejected(f"cannot parse SQL: {exc}") from None
    if len(statements) != 1:
        raise QueryRejected(f"send exactly one statement (got {len(statements)})")
    if statements[0].type != duckdb.StatementType.SELECT:
        raise QueryRejected(f"only read-only SELECT queries are allowed (got {statements[0].type.name})")
    try:
        row = con.execute("SELECT json_serialize_sql($1)", [sql]).fetchone()
        tree = json.loads(row[0]) if row is not None else {}
    except (duckdb.Error, ValueError) as exc:
        raise QueryRejected(f"cannot check this query: {exc}") from None
    guard = guard or QueryGuard.of(con)
    reason = sql_guard.refusal(tree, guard.table_functions, guard.denied)
    if reason is not None:
        raise QueryRejected(reason)


class LedgerThread:
    """Owns a :class:`Ledger`: writes on one dedicated thread; operator queries on ``num_query_readers``
    others (``self.queries``, sql_runner.py)."""

    def __init__(self, path: Path, limits: Limits | None = None, num_query_readers: int = 1) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="duckdb")
        self.ledger: Ledger = self._pool.submit(Ledger, path, False, limits, num_query_readers).result()

    def submit(self, fn: Callable[[Ledger], T]) -> concurrent.futures.Future[T]:
        def write() -> T:
            try:
                return fn(self.ledger)
            finally:
                self.ledger.secure_files()  # a new WAL after a checkpoint is created with the umask's mode

        return self._pool.submit(write)

    def close(self) -> None:
        self.ledger.interrupt()
        self._pool.submit(self.ledger.close).result()
        self._pool.shutdown(wait=True)
