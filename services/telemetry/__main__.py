"""``llmgw telemetry``: config → wiring → run."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from proto import subjects
from services.common import pool_config
from services.common.bus import bus_session, nats_url_from_env
from services.common.runtime import ConfigError, announce, data_dir, run_async_main, setup_logging
from services.telemetry.probe import Member
from services.telemetry.service import TelemetryConfig, TelemetryService


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--member", action="append", default=[], metavar="ID=URL",
                        help="an HTTP engine to watch (repeatable; also $LLMGW_TELEMETRY_MEMBERS, comma-separated)")
    parser.add_argument("--config", default=os.environ.get("LLMGW_CONFIG"),
                        help="the gateway's pools file: its HTTP members are watched (also $LLMGW_CONFIG)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between probes (>= 0.1)")
    parser.add_argument("--nats", help="NATS URL (default: $NATS_URL, else an embedded server)")
    parser.add_argument("--data-dir", help="data directory (default: $LLMGW_DATA_DIR or ./data)")


def build_config(args: argparse.Namespace) -> TelemetryConfig:
    specs = list(args.member)
    env = os.environ.get("LLMGW_TELEMETRY_MEMBERS", "")
    specs += [s for s in env.split(",") if s.strip()]
    members = []
    for spec in specs:
        member_id, sep, url = spec.strip().partition("=")
        if not sep or not url.startswith(("http://", "https://")):
            raise ConfigError("member", f"{spec!r} must look like ID=http://host:port")
        try:
            subjects.check_id(member_id)
        except ValueError as exc:
            raise ConfigError("member", str(exc)) from None
        members.append(Member(member_id, url))
    if args.config:
        known = {m.member_id for m in members}
        for m in pool_config.load(Path(args.config)).http_members():
            if m.member_id not in known:
                members.append(Member(m.member_id, m.backend))
    if args.interval < 0.1:
        raise ConfigError("interval", "must be >= 0.1 seconds")
    return TelemetryConfig(members=tuple(members), interval_s=args.interval)


async def run(args: argparse.Namespace) -> None:
    config = build_config(args)
    async with bus_session(nats_url_from_env(args.nats), "telemetry", data_dir(args.data_dir)) as nc:
        announce("telemetry", f"watching {len(config.members)} HTTP member(s) every {config.interval_s:g}s")
        await TelemetryService(nc, config).run()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmgw telemetry")
    add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging()
    run_async_main(lambda: run(args), "telemetry")


if __name__ == "__main__":
    main()
