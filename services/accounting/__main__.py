"""``llmgw accounting``: config → wiring → run.

What it wires: flags, the pools file's prices and ``--tariff`` rates → ``AccountingConfig``; one NATS
connection (``services.common.bus``) → ``AccountingService`` (service.py: the durable ``USAGE``/``ENERGY``
consumers, the DuckDB ledger in store.py, the ``llm.v1.accounting.{sql,costs,key_energy}`` responders and
the admin HTTP server), run until a signal under ``run_async_main``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
from pathlib import Path

from proto import pools as pool_config
from services.accounting.intervals import Limits
from services.accounting.service import AccountingConfig, AccountingService, DatedRate, price_book_of
from services.accounting.sql_runner import QueryLimits
from services.accounting.store import PriceBookEntry
from services.common.bus import bus_session, nats_url_from_env
from services.common.energy_counter import DEFAULT_MAX_RAPL_POWER_W
from services.common.runtime import ConfigError, announce, data_dir, run_async_main, setup_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats", help="NATS URL (default: $NATS_URL, else an embedded server)")
    parser.add_argument("--data-dir", help="data directory (default: $LLMGW_DATA_DIR or ./data)")
    parser.add_argument("--db", help="DuckDB file (default: DATA_DIR/accounting.duckdb)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address for POST /sql and GET /costs")
    parser.add_argument("--port", help="HTTP port (default: $LLMGW_ACCOUNTING_PORT, else 0 = any free port)")
    parser.add_argument("--electricity-rate", type=float,
                        help="$ per kWh from now on (default: the gateway's pools file, else 0.125)")
    parser.add_argument("--tariff", action="append", default=[], metavar="YYYY-MM-DD=RATE",
                        help="a dated rate: $ per kWh in force from that UTC date (or ISO datetime) until the next "
                             "one; repeatable. Energy already rolled up from then on is priced again")
    parser.add_argument("--price-book", help='JSON file: {"<model or *>": {"prompt_usd_per_m": …, '
                                             '"cached_usd_per_m": …, "output_usd_per_m": …}} '
                                             "(default: the pools file's price_book)")
    parser.add_argument("--config", default=os.environ.get("LLMGW_CONFIG") or None,
                        help="the gateway's pools file, for the electricity rate and price book (default: "
                             "$LLMGW_CONFIG, else DATA_DIR/pools.json when present); later edits arrive over "
                             "the bus from the gateway's Config page")
    parser.add_argument("--retention-days", type=float, default=30.0, help="raw energy samples kept (default 30)")
    parser.add_argument("--export-dir", help="Parquet export of the rollups (default: DATA_DIR/exports)")
    parser.add_argument("--query-timeout", type=float, default=QueryLimits.timeout_s,
                        help="operator query limit in s, counted from the start of its execution (default "
                             f"{QueryLimits.timeout_s:g})")
    parser.add_argument("--max-result-bytes", type=int, default=QueryLimits.max_result_bytes,
                        help="the most JSON bytes one operator query may answer; over it the query fails with "
                             f"result_too_large (default {QueryLimits.max_result_bytes}; the bus answer also stays "
                             "under the NATS server's max_payload)")
    parser.add_argument("--max-concurrent-queries", type=int, default=QueryLimits.num_readers,
                        help="operator queries run at once, each on its own reader "
                             f"(default {QueryLimits.num_readers})")
    parser.add_argument("--max-queued-queries", type=int, default=QueryLimits.max_queued,
                        help="operator queries waiting for a reader; more are refused at once with 503 and "
                             f"Retry-After (default {QueryLimits.max_queued})")
    parser.add_argument("--max-gap", type=float, default=60.0,
                        help="seconds between energy samples above which an interval is flagged as a gap")
    parser.add_argument("--max-rapl-power-w", type=float, default=DEFAULT_MAX_RAPL_POWER_W,
                        help="the most one RAPL zone (a CPU package) can draw: an interval long enough for its "
                             "counter to run through its whole range at this power may hide a wrap and is "
                             f"rapl_ambiguous, NULL (default {DEFAULT_MAX_RAPL_POWER_W:g})")


def load_price_book(path: str | None) -> dict[str, PriceBookEntry]:
    if path is None:
        return {}
    try:
        raw = json.loads(Path(path).read_text())
        return {model: PriceBookEntry(float(p["prompt_usd_per_m"]), float(p.get("cached_usd_per_m", 0.0)),
                                      float(p["output_usd_per_m"])) for model, p in raw.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError("price-book", f"cannot read {path}: {exc}") from None


def parse_tariff(text: str) -> DatedRate:
    """``YYYY-MM-DD=RATE`` or ``<ISO datetime>=RATE``: a date is its UTC midnight, a datetime without an
    offset is UTC. RATE is $ per kWh, finite and >= 0."""
    when, sep, rate_text = text.rpartition("=")

    def bad(reason: str) -> ConfigError:
        return ConfigError("tariff", f"--tariff {text!r}: {reason} (expected YYYY-MM-DD=RATE, e.g. 2026-03-01=0.15)")

    if not sep or not when.strip():
        raise bad("no date")
    try:
        moment = dt.datetime.fromisoformat(when.strip())
    except ValueError:
        raise bad(f"{when!r} is not a date or ISO datetime") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    try:
        rate = float(rate_text)
    except ValueError:
        raise bad(f"{rate_text!r} is not a rate in $ per kWh") from None
    if not math.isfinite(rate) or rate < 0:
        raise bad(f"the rate must be a finite number >= 0, not {rate_text!r}")
    return DatedRate(effective_s=moment.timestamp(), usd_per_kwh=rate)


def parse_tariffs(texts: list[str]) -> tuple[DatedRate, ...]:
    """Every ``--tariff``, oldest first; two different rates for one moment are an error."""
    rates: dict[float, tuple[DatedRate, str]] = {}
    for text in texts:
        rate = parse_tariff(text)
        earlier = rates.get(rate.effective_s)
        if earlier is not None and earlier[0] != rate:
            raise ConfigError("tariff", f"--tariff {earlier[1]!r} and --tariff {text!r} give two rates for one moment")
        rates[rate.effective_s] = (rate, text)
    return tuple(sorted((r for r, _ in rates.values()), key=lambda r: r.effective_s))


def build_config(args: argparse.Namespace, data: Path) -> AccountingConfig:
    port_text = args.port if args.port is not None else os.environ.get("LLMGW_ACCOUNTING_PORT", "0")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError("port", f"not a port number: {port_text!r}") from None
    if not 0 <= port <= 65535:
        raise ConfigError("port", f"out of range: {port}")
    pools_path = Path(args.config) if args.config else data / "pools.json"
    pools = pool_config.load(pools_path) if args.config or pools_path.exists() else pool_config.GatewayFileConfig()
    rate = args.electricity_rate if args.electricity_rate is not None else pools.electricity_rate_usd_per_kwh
    if not math.isfinite(rate) or rate < 0:
        raise ConfigError("electricity-rate", "must be a finite number >= 0")
    tariff = parse_tariffs(args.tariff)
    price_book = load_price_book(args.price_book) if args.price_book else price_book_of(pools)
    if args.retention_days <= 0:
        raise ConfigError("retention-days", "must be > 0")
    if not (math.isfinite(args.query_timeout) and args.query_timeout > 0):
        raise ConfigError("query-timeout", "must be a finite number of seconds > 0")
    if args.max_result_bytes < 1024:
        raise ConfigError("max-result-bytes", f"must be at least 1024, got {args.max_result_bytes}")
    if not 1 <= args.max_concurrent_queries <= 64:
        raise ConfigError("max-concurrent-queries", f"must be 1..64, got {args.max_concurrent_queries}")
    if not 0 <= args.max_queued_queries <= 1000:
        raise ConfigError("max-queued-queries", f"must be 0..1000, got {args.max_queued_queries}")
    if not (math.isfinite(args.max_rapl_power_w) and args.max_rapl_power_w > 0):
        raise ConfigError("max-rapl-power-w", f"must be a finite number of watts > 0, got {args.max_rapl_power_w}")
    return AccountingConfig(
        db_path=Path(args.db) if args.db else data / "accounting.duckdb",
        host=args.host, port=port, electricity_rate_usd_per_kwh=rate, tariff=tariff,
        price_book=price_book, retention_days=args.retention_days,
        export_dir=Path(args.export_dir) if args.export_dir else data / "exports",
        query_timeout_s=args.query_timeout, max_result_bytes=args.max_result_bytes,
        num_query_readers=args.max_concurrent_queries, max_queued_queries=args.max_queued_queries,
        limits=Limits(max_gap_s=args.max_gap, max_rapl_power_w=args.max_rapl_power_w),
    )


async def run(args: argparse.Namespace) -> None:
    data = data_dir(args.data_dir)
    config = build_config(args, data)
    async with bus_session(nats_url_from_env(args.nats), "accounting", data) as nc:
        service = AccountingService(nc, config)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(service.run())
            await service.ready.wait()  # a failing run() cancels this wait through the group
            announce("accounting", f"listening on {service.url}; ledger {config.db_path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmgw accounting")
    add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging()
    # Every file this process creates (the ledger, each new .wal after a checkpoint, Parquet exports) is
    # the owner's alone: the ledger holds every request's key, model and tokens (docs/deploy.md).
    os.umask(0o077)
    run_async_main(lambda: run(args), "accounting")


if __name__ == "__main__":
    main()
