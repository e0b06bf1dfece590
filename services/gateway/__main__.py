"""``llmgw gateway``: config → wiring → run.

What it wires: flags → ``GatewayConfig``, the pools file (``proto.pools``) → ``GatewayFileConfig``; one
NATS connection (``services.common.bus``) → ``GatewayService`` (service.py, which wires the forwarder,
the usage publisher, the pools file, the peers, heartbeat intake and the pages), served on its HTTP port
until a signal under ``run_async_main``. With ``--workers N`` (N > 1) this process runs none of that itself: it
supervises N worker processes that each do (services/gateway/workers.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from proto import pools as pool_config
from services.common.bus import bus_session, nats_url_from_env
from services.common.runtime import (
    ConfigError,
    announce,
    data_dir,
    default_worker_id,
    run_async_main,
    setup_logging,
)
from services.gateway.auth import parse_networks
from services.gateway.service import GatewayConfig, GatewayService
from services.gateway.workers import MAX_DEFAULT_WORKERS, Supervisor, default_workers

DEFAULT_PORT = 8080


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=os.environ.get("LLMGW_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ["LLMGW_PORT"]) if os.environ.get("LLMGW_PORT")
                        else None, help=f"listen port (0 picks a free one; default: $LLMGW_PORT, else the pools "
                                        f"file's gateway.port, else {DEFAULT_PORT})")
    parser.add_argument("--gateway-id", default=os.environ.get("LLMGW_GATEWAY_ID") or None)
    parser.add_argument("--nats", help="NATS URL (default: $NATS_URL, else an embedded server)")
    parser.add_argument("--data-dir", help="data directory (default: $LLMGW_DATA_DIR or ./data)")
    parser.add_argument("--config", default=os.environ.get("LLMGW_CONFIG") or None,
                        help="pools file (JSON; see docs/architecture.md); reloaded on change (also $LLMGW_CONFIG)")
    parser.add_argument("--stale-after", type=float, default=None,
                        help="seconds before a heartbeat is stale (default: the pools file's "
                             "metrics.stale_threshold, 3 s; sooner for a member that misses two of its heartbeats)")
    parser.add_argument("--trust-network", action="append", default=[], metavar="CIDR",
                        help="callers from this network may run inference without an API key (repeatable; also "
                             "$LLMGW_TRUST_NETWORKS, comma-separated). Nothing is trusted by default, not even "
                             "loopback")
    parser.add_argument("--max-in-flight", type=int, default=GatewayConfig.max_in_flight,
                        help="inference requests this process holds open before new ones get an immediate 503 "
                             "gateway_overloaded with Retry-After (default %(default)s)")
    parser.add_argument("--max-loop-lag", type=float, default=GatewayConfig.max_loop_lag_s, metavar="SECONDS",
                        help="event-loop lag (median of the last 3 probes, 10 ms apart) past which this process "
                             "lowers its in-flight limit and sheds new inference requests with 503 (default "
                             "%(default)s)")
    parser.add_argument("--workers", type=int, default=_workers_from_env(), metavar="N",
                        help="gateway processes on the one port, each a replica on the bus (default: $LLMGW_WORKERS, "
                             f"else one per core, at most {MAX_DEFAULT_WORKERS}; 1: a single process)")
    # set by the parent of --workers for each worker it starts (services/gateway/workers.py)
    parser.add_argument("--worker-slot", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-group", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)


def _workers_from_env() -> int:
    text = os.environ.get("LLMGW_WORKERS", "").strip()
    if not text:
        return default_workers()
    try:
        return int(text)
    except ValueError:
        raise ConfigError("LLMGW_WORKERS", f"must be a whole number, got {text!r}") from None


def build_config(args: argparse.Namespace, file_config: pool_config.GatewayFileConfig | None = None) -> GatewayConfig:
    """The gateway's settings from its flags; the port, when no flag or $LLMGW_PORT names one, is the pools
    file's ``gateway.port`` (a Go gateway's file names its port there), else 8080."""
    if args.port is not None and not 0 <= args.port <= 65535:
        raise ConfigError("port", f"must be 0..65535, got {args.port}")
    if args.stale_after is not None and args.stale_after <= 0:
        raise ConfigError("stale-after", "must be > 0")
    if args.max_in_flight < 1:
        raise ConfigError("max-in-flight", f"must be at least 1, got {args.max_in_flight}")
    if not args.max_loop_lag > 0:  # also refuses NaN
        raise ConfigError("max-loop-lag", f"must be > 0 seconds, got {args.max_loop_lag}")
    if args.workers < 1:
        raise ConfigError("workers", f"must be at least 1, got {args.workers}")
    is_worker = args.worker_slot is not None and args.workers > 1
    trusted = [*args.trust_network, *(s for s in os.environ.get("LLMGW_TRUST_NETWORKS", "").split(",") if s.strip())]
    parse_networks(trusted)  # a bad CIDR is a ConfigError naming the flag
    return GatewayConfig(
        gateway_id=args.gateway_id or default_worker_id("gw"), host=args.host,
        port=args.port if args.port is not None else (
            file_config.limits.port if file_config is not None and file_config.limits.port is not None
            else DEFAULT_PORT),
        stale_after_s=args.stale_after, config_path=Path(args.config) if args.config else None,
        data_dir=data_dir(args.data_dir), trusted_networks=tuple(trusted),
        max_in_flight=args.max_in_flight, max_loop_lag_s=args.max_loop_lag,
        worker=f"w{args.worker_slot}" if is_worker else "", num_workers=args.workers if is_worker else 1,
        worker_group=args.worker_group if is_worker else None,
        reuse_port=is_worker and args.listen_fd is None, listen_fd=args.listen_fd if is_worker else None,
    )


def _file_config(args: argparse.Namespace) -> pool_config.GatewayFileConfig | None:
    if not args.config:
        return None
    path = Path(args.config)
    if not path.is_file():
        raise ConfigError("config", f"{path} does not exist (or is not a file)")
    try:
        return pool_config.load(path)
    except ConfigError:
        return None  # the service runs on the last good config and says why (pools_file.py)


async def supervise(args: argparse.Namespace, argv: list[str]) -> None:
    """``--workers N`` (N > 1): this process supervises N gateway processes (services/gateway/workers.py)."""
    config = build_config(args, _file_config(args))  # every flag checked once, here, before any worker starts
    await Supervisor(argv, args, args.workers, config.port).run()


async def run(args: argparse.Namespace) -> None:
    file_config = _file_config(args)
    config = build_config(args, file_config)
    data = data_dir(args.data_dir)
    async with bus_session(nats_url_from_env(args.nats), f"gateway:{config.gateway_id}", data) as nc:
        service = GatewayService(nc, config, file_config)
        async with service.running(), service.serving() as url:
            announce("gateway", f"listening on {url}")
            await asyncio.Event().wait()  # until SIGINT/SIGTERM cancels us


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmgw gateway")
    try:
        add_arguments(parser)
    except ConfigError as exc:
        parser.error(str(exc))
    args = parser.parse_args(argv)
    setup_logging()
    if args.workers > 1 and args.worker_slot is None:
        given = list(sys.argv[1:] if argv is None else argv)
        run_async_main(lambda: supervise(args, given), "gateway")
        return
    run_async_main(lambda: run(args), "gateway")


if __name__ == "__main__":
    main()
