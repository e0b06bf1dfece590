"""``llmgw engine MODEL_PATH``: load the model, join the bus as a worker, serve until stopped."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from proto import subjects
from services.common.bus import bus_session, nats_url_from_env
from services.common.runtime import (
    ConfigError,
    announce,
    data_dir,
    default_worker_id,
    run_async_main,
    setup_logging,
)
from services.engine.async_engine import AsyncEngine
from services.engine.engine_core import EngineConfig, EngineCore
from services.engine.errors import EngineError
from services.engine.worker import BusWorker, WorkerConfig

log = logging.getLogger("llmgw.engine")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_path", help="HF checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    parser.add_argument("--model-id", help="the name clients use (default: the directory's name)")
    parser.add_argument("--worker-id", help="bus worker id (default: engine-<host>-<pid>)")
    parser.add_argument("--nats", help="NATS URL (default: $NATS_URL, else an embedded server)")
    parser.add_argument("--data-dir", help="data directory (default: $LLMGW_DATA_DIR or ./data)")
    parser.add_argument("--device", default="cpu", help="torch device: cpu or cuda[:N]")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="weights dtype")
    parser.add_argument("--max-concurrency", type=int, default=8, help="lanes: requests running at once")
    parser.add_argument("--max-pending-requests", type=int, default=64, help="bounded waiting queue")
    parser.add_argument("--max-context", type=int, help="per-request limit on prompt + max_tokens")
    parser.add_argument("--kv-capacity", type=int, help="KV cache size in tokens (default: from free memory)")
    parser.add_argument("--kv-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--heartbeat-interval", type=float, default=0.5, help="seconds between heartbeats")
    parser.add_argument("--preserve-thinking", action="store_true",
                        help="keep <think> blocks of earlier assistant turns in the prompt")


def build_config(args: argparse.Namespace) -> tuple[EngineConfig, WorkerConfig]:
    path = Path(args.model_path)
    for key in ("max_concurrency", "max_pending_requests"):
        if getattr(args, key) < (1 if key == "max_concurrency" else 0):
            raise ConfigError(key.replace("_", "-"), f"out of range: {getattr(args, key)}")
    if not 0.1 <= args.heartbeat_interval <= 10:
        raise ConfigError("heartbeat-interval", "must be between 0.1 and 10 seconds")
    worker_id = args.worker_id or default_worker_id("engine")
    try:
        subjects.check_id(worker_id)
    except ValueError as exc:
        raise ConfigError("worker-id", str(exc)) from None
    engine = EngineConfig(
        model_path=path, model_id=args.model_id, dtype=args.dtype, device=args.device, kv_dtype=args.kv_dtype,
        kv_capacity_tokens=args.kv_capacity, max_concurrency=args.max_concurrency,
        max_pending_requests=args.max_pending_requests, max_context=args.max_context,
        preserve_thinking=args.preserve_thinking,
    )
    return engine, WorkerConfig(worker_id=worker_id, heartbeat_interval_s=args.heartbeat_interval)


async def run(args: argparse.Namespace) -> None:
    engine_config, worker_config = build_config(args)
    core = await asyncio.to_thread(EngineCore, engine_config)
    log.info("%s", core.describe())
    async with (
        bus_session(nats_url_from_env(args.nats), f"engine:{worker_config.worker_id}", data_dir(args.data_dir)) as nc,
        AsyncEngine(core) as engine,
    ):
        worker = BusWorker(nc, engine, worker_config)
        subject = subjects.gen(worker_config.worker_id)
        announce("engine", f"worker {worker_config.worker_id} serving {core.model_id} on {subject}")
        await worker.run()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmgw engine")
    add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging()
    run_async_main(lambda: run(args), "engine", clean_errors=(EngineError,))


if __name__ == "__main__":
    main()
