"""``llmgw telemetry``: config → wiring → run.

What it wires: ``--member``/``--discover`` flags and the pools file's HTTP members → ``TelemetryConfig``;
one NATS connection (``services.common.bus``) → ``TelemetryService`` (service.py: one scrape loop per
member over scraper.py, heartbeats on ``llm.v1.hb.<id>`` and energy on ``ENERGY``, its own ``/metrics``),
run until a signal under ``run_async_main``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from proto import pools as pool_config
from proto import subjects
from services.common.bus import bus_session, nats_url_from_env
from services.common.http import serving
from services.common.runtime import ConfigError, announce, data_dir, run_async_main, setup_logging
from services.telemetry import discovery, schedule
from services.telemetry.probe import Member
from services.telemetry.service import TelemetryConfig, TelemetryService


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--member", action="append", default=[], metavar="ID=URL",
                        help="an HTTP engine to watch (repeatable; also $LLMGW_TELEMETRY_MEMBERS, comma-separated)")
    parser.add_argument("--config", default=os.environ.get("LLMGW_CONFIG") or None,
                        help="the gateway's pools file: its HTTP members are watched (also $LLMGW_CONFIG)")
    parser.add_argument("--discover", action="append", default=[], metavar="HOST:PORT-PORT",
                        help="probe these ports with GET /v1/models and watch what answers (repeatable)")
    parser.add_argument("--lanes", action="append", default=[], metavar="ID=N",
                        help="a member's lane count (vLLM's max_num_seqs, which vLLM does not export; repeatable): "
                             "wins over the pools file's max_seqs / metrics.backend_max_seqs")
    parser.add_argument("--interval", type=float, default=None,
                        help="seconds between scrapes (>= 0.1; default: the pools file's metrics.poll_interval, "
                             "which then follows the file's changes, else 1.0)")
    parser.add_argument("--timeout", type=float, default=schedule.DEFAULT_TIMEOUT_S,
                        help="seconds one request may take (at most the scrape interval, at least "
                             f"{schedule.MIN_REQUEST_TIMEOUT_S:g}); a timed-out request is retried once")
    parser.add_argument("--energy-interval", type=float, default=5.0,
                        help="seconds between energy samples per member (engine-reported energy)")
    parser.add_argument("--host", default="127.0.0.1", help="address of telemetry's /metrics server")
    parser.add_argument("--port", type=int, default=None,
                        help="port of telemetry's /metrics server (default: $LLMGW_TELEMETRY_PORT, else 0 = any)")
    parser.add_argument("--nats", help="NATS URL (default: $NATS_URL, else an embedded server)")
    parser.add_argument("--data-dir", help="data directory (default: $LLMGW_DATA_DIR or ./data)")


def _pairs(specs: list[str], key: str, example: str) -> list[tuple[str, str]]:
    out = []
    for spec in specs:
        left, sep, right = spec.strip().partition("=")
        if not sep or not right:
            raise ConfigError(key, f"{spec!r} must look like {example}")
        try:
            subjects.check_id(left)
        except ValueError as exc:
            raise ConfigError(key, str(exc)) from None
        out.append((left, right))
    return out


def _port(flag: int | None) -> int:
    raw = str(flag) if flag is not None else os.environ.get("LLMGW_TELEMETRY_PORT", "0")
    if not raw.isdigit() or int(raw) > 65535:
        raise ConfigError("port", f"{raw!r} must be a port number (0 picks a free one)")
    return int(raw)


def build_config(args: argparse.Namespace) -> TelemetryConfig:
    env = os.environ.get("LLMGW_TELEMETRY_MEMBERS", "")
    specs = [*args.member, *(s for s in env.split(",") if s.strip())]
    lanes = {}
    for member_id, value in _pairs(args.lanes, "lanes", "ID=256"):
        if not value.isdigit() or int(value) < 1:
            raise ConfigError("lanes", f"{member_id}: {value!r} must be a positive integer")
        lanes[member_id] = int(value)
    members = []
    for member_id, url in _pairs(specs, "member", "ID=http://host:port"):
        if not url.startswith(("http://", "https://")):
            raise ConfigError("member", f"{member_id}={url!r} must look like ID=http://host:port")
        members.append(Member(member_id, url.rstrip("/"), lanes.get(member_id)))
    from_pools = set()
    interval_s = schedule.DEFAULT_INTERVAL_S  # the pools file's metrics.poll_interval default, when no file
    default_lanes = pool_config.MetricsConfig().default_lanes
    # the gateway's pools file: --config, else the one its Config page saves in the data dir
    pools_path = Path(args.config) if args.config else data_dir(args.data_dir) / "pools.json"
    if args.config or pools_path.exists():
        known = {m.member_id for m in members}
        pools = pool_config.load(pools_path)
        interval_s = pools.metrics.poll_interval  # pool_config bounds it to 0.1..60 s
        default_lanes = pools.metrics.default_lanes
        for m in pools.http_members():
            if m.member_id not in known:
                declared = lanes.get(m.member_id) or pools.metrics.max_seqs_for(m)
                members.append(Member(m.member_id, m.backend.rstrip("/"), declared, m.api_key))
                from_pools.add(m.member_id)
    unknown = sorted(set(lanes) - {m.member_id for m in members})
    if unknown:
        raise ConfigError("lanes", f"no member {unknown[0]!r}")
    if args.interval is not None:  # the operator's flag wins over the pools file, now and at its changes
        if not args.interval >= schedule.MIN_INTERVAL_S:
            raise ConfigError("interval", f"must be >= {schedule.MIN_INTERVAL_S:g} seconds")
        if args.energy_interval < args.interval:
            raise ConfigError("energy-interval", "must be >= --interval")
        interval_s = args.interval
    if args.timeout <= 0:
        raise ConfigError("timeout", "must be > 0 seconds")
    return TelemetryConfig(members=tuple(members), interval_s=interval_s, is_interval_from_pools=args.interval is None,
                           timeout_s=args.timeout, energy_interval_s=args.energy_interval,
                           discover=tuple(discovery.parse_range(s) for s in args.discover),
                           from_pools=frozenset(from_pools), default_lanes=default_lanes, flag_lanes=lanes)


async def run(args: argparse.Namespace) -> None:
    config = build_config(args)
    port = _port(args.port)
    async with bus_session(nats_url_from_env(args.nats), "telemetry", data_dir(args.data_dir)) as nc:
        service = TelemetryService(nc, config)
        async with serving(service.app(), args.host, port) as url, asyncio.TaskGroup() as tasks:
            tasks.create_task(service.run(), name="telemetry")
            source = " (the pools file's metrics.poll_interval)" if config.is_interval_from_pools else ""
            discovering = f", discovering {len(config.discover)} range(s)" if config.discover else ""
            announce("telemetry", f"{url} watching {len(config.members)} HTTP member(s) every "
                                  f"{config.interval_s:g}s{source}{discovering}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmgw telemetry")
    add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging()
    run_async_main(lambda: run(args), "telemetry")


if __name__ == "__main__":
    main()
