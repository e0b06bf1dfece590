"""``llmgw accounting``: config → wiring → run."""

from __future__ import annotations

import argparse
from pathlib import Path

from services.accounting.service import AccountingConfig, AccountingService
from services.common.bus import bus_session, nats_url_from_env
from services.common.runtime import announce, data_dir, run_async_main, setup_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats", help="NATS URL (default: $NATS_URL, else an embedded server)")
    parser.add_argument("--data-dir", help="data directory (default: $LLMGW_DATA_DIR or ./data)")
    parser.add_argument("--db", help="DuckDB file (default: DATA_DIR/accounting.duckdb)")


async def run(args: argparse.Namespace) -> None:
    data = data_dir(args.data_dir)
    config = AccountingConfig(db_path=Path(args.db) if args.db else data / "accounting.duckdb")
    async with bus_session(nats_url_from_env(args.nats), "accounting", data) as nc:
        service = AccountingService(nc, config)
        announce("accounting", f"consuming usage into {config.db_path}")
        await service.run()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmgw accounting")
    add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging()
    run_async_main(lambda: run(args), "accounting")


if __name__ == "__main__":
    main()
