"""``ninfer-serve MODEL_PATH [flags]`` (also ``llmgw engine``): load the model, serve the OpenAI API and
the telemetry endpoints over HTTP, and with ``--nats`` (or ``NATS_URL``) join the bus as a worker.

Accepts the runbook's command line verbatim (shared/reference/interop.md). Flags whose feature is not
built yet stop the start with a message saying so; none is silently ignored. ``--spec ngram``, ``--spec
draft --draft-model PATH`` and ``--spec mtp`` serve; ``--spec mtp`` on a checkpoint without ``mtp.*``
tensors fails at start naming the alternatives. With ``--spec mtp`` the MTP module always uses the main
LM head (it has none of its own), so ``--lm-head-draft`` is accepted and changes nothing.

What it wires (config -> wiring -> run; the only place that configures logging):
  flags -> ``EngineConfig`` (config.py), ``ServeConfig`` (serve/http.py), ``WorkerConfig`` (serve/worker.py);
  the engine core (engine_core.py: model/, core/, spec/) on a thread (``--in-process``: serve/async_engine.py
  ``AsyncEngine``) or in a child process (serve/process_engine.py ``ProcessEngine``), behind one ``EngineHandle``;
  the energy meter (serve/energy.py) and ``EngineService``, the HTTP face (serve/http.py: OpenAI API,
  ``/metrics``, ``/slots``, ``/usage``, energy samples to the bus, the usage ledger);
  with ``--nats``: the bus connection and ``BusWorker``, the bus face (serve/worker.py: ``llm.v1.gen.<id>``,
  cancels, heartbeats, ``deadline_s``). Both faces translate requests through serve/frontend.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
from pathlib import Path

from proto import subjects
from services.common.bus import connect, drain_quietly, ensure_bus
from services.common.energy_counter import DEFAULT_MAX_RAPL_POWER_W
from services.common.runtime import (
    ConfigError,
    announce,
    data_dir,
    default_worker_id,
    run_async_main,
    setup_logging,
)
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.errors import CoreLostError, EngineError
from services.engine.kernels.backend import BackendUnavailableError, select_backend
from services.engine.model.artifact import materialize
from services.engine.model.loader import QUANT_DEQUANT_MODES
from services.engine.model.pooler import POOLING_TYPES
from services.engine.serve.async_engine import AsyncEngine, EngineHandle
from services.engine.serve.energy import detect_meter
from services.engine.serve.http import EngineService, ServeConfig, http_site
from services.engine.serve.process_engine import ProcessEngine
from services.engine.serve.worker import BusWorker, WorkerConfig
from services.engine.spec.spec_decode import (
    DEFAULT_DRAFT_TOKENS,
    MAX_DRAFT_TOKENS,
    MIN_DRAFT_TOKENS,
    SPEC_METHODS,
    SpecConfig,
)

log = logging.getLogger("ninfer.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_path", help="HF checkpoint directory, or a single-file .ninfer artifact")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8006, help="HTTP port (default 8006; 0 picks a free one)")
    parser.add_argument("--model-id", help="the name clients use (default: the model's file or directory name)")
    parser.add_argument("--max-context", type=int, help="per-request limit on prompt + max_tokens")
    parser.add_argument("--kv-dtype", choices=["auto", "fp8"], default="auto", help="KV cache storage dtype")
    parser.add_argument("--quant-dequant", choices=list(QUANT_DEQUANT_MODES), default="load",
                        help="a quantized checkpoint (FP8, NVFP4, AWQ, GPTQ): dequantise its weights once at load "
                             "(dense memory, dense speed) or inside every product (per-product: the packed bytes "
                             "stay resident; on the triton backend the Triton GEMMs dequantise in the tile); "
                             "auto: per-product on the triton backend, load on torch. Default load: the in-tile "
                             "kernels are interpreter-tested only, not yet run on a GPU (docs/quantization.md)")
    parser.add_argument("--max-concurrency", type=int, default=8, help="lanes: requests running at once")
    parser.add_argument("--max-pending-requests", type=int, default=64, help="bounded waiting queue")
    parser.add_argument("--kv-capacity", type=_kv_capacity, metavar="TOKENS|auto",
                        help="KV cache size in tokens; auto (the default): sized from free VRAM on a GPU, free RAM "
                             "on the CPU (the start-up log prints the free-memory line and the capacity chosen)")
    parser.add_argument("--spec", choices=list(SPEC_METHODS), default="none",
                        help="speculative decoding: ngram (prompt lookup), draft (--draft-model), mtp (the "
                             "checkpoint's own mtp.* module; refused at start when it has none)")
    parser.add_argument("--draft-model", type=Path,
                        help="draft checkpoint for --spec draft (smaller, same tokenizer as the model)")
    parser.add_argument("--draft-tokens", type=int,
                        help=f"draft tokens per speculative step ({MIN_DRAFT_TOKENS}..{MAX_DRAFT_TOKENS}, "
                             f"default {DEFAULT_DRAFT_TOKENS})")
    parser.add_argument("--lm-head-draft", action="store_true",
                        help="draft logits through the main model's LM head: --spec draft; with --spec mtp "
                             "that is always so (accepted, no effect)")
    parser.add_argument("--preserve-thinking", action="store_true",
                        help="keep the reasoning of earlier assistant turns (their reasoning_content, or <think> "
                             "blocks in their content) in the prompt")
    parser.add_argument("--no-thinking", action="store_true",
                        help="render chat templates with enable_thinking=False (a request's "
                             "chat_template_kwargs.enable_thinking still wins)")
    parser.add_argument("--reasoning-effort", choices=["none", "minimal", "low", "medium", "high"],
                        help="default reasoning effort (a request's reasoning_effort wins): the thinking-token "
                             "budget after which the engine closes </think> and answers; none = no thinking; "
                             "default: no budget")
    parser.add_argument("--reasoning-budget-tokens", default="1024,4096,16384", metavar="LOW,MEDIUM,HIGH",
                        help="thinking tokens each reasoning effort allows (default 1024,4096,16384; minimal is 0)")
    parser.add_argument("--pooling", choices=list(POOLING_TYPES), default="last",
                        help="/v1/embeddings: the last token's hidden state (default, as vLLM pools decoder "
                             "models) or the mean over every token; either is L2-normalised")
    parser.add_argument("--electricity-rate", type=float, default=0.125, help="USD per kWh for /usage costs")
    parser.add_argument("--metrics-state", type=Path, help="file that persists token totals and daily energy")
    parser.add_argument("--api-key", default=os.environ.get("NINFER_API_KEY") or None,
                        help="require 'Authorization: Bearer KEY' on /v1/* (also $NINFER_API_KEY)")
    parser.add_argument("--nats", help="join the bus as a worker at this NATS URL (also $NATS_URL)")
    parser.add_argument("--device", default="cpu", help="torch device: cpu or cuda[:N]")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("LLMGW_ENGINE_THREADS") or "0") or None,
                        help="torch CPU threads for the model (default on the CPU: every core; with "
                             "--in-process one fewer, so the event loop keeps a core; also $LLMGW_ENGINE_THREADS)")
    parser.add_argument("--stream-interval-ms", type=_stream_interval, default=20.0, metavar="MS",
                        help="send a streaming request's tokens at most every MS milliseconds, merged (its first "
                             "text and its end are never held; default 20); 0: every token at once")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="decode eagerly on CUDA (default: decode steps replay CUDA graphs captured at start)")
    parser.add_argument("--in-process", action="store_true",
                        help="run the engine core on a thread of the API process instead of its own child "
                             "process (one process to debug; slower under load: the two share one GIL)")
    parser.add_argument("--backend", choices=["auto", "torch", "triton"], default=None,
                        help="kernels: auto = Triton on CUDA, else torch (default; also $LLMGW_ENGINE_BACKEND)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="weights dtype")
    parser.add_argument("--worker-id", default=os.environ.get("LLMGW_WORKER_ID"),
                        help="bus worker id (default: $LLMGW_WORKER_ID, else engine-<host>-<pid>)")
    parser.add_argument("--data-dir", help="data directory (default: $LLMGW_DATA_DIR or ./data)")
    parser.add_argument("--heartbeat-interval", type=float, default=0.5, help="seconds between bus heartbeats")
    parser.add_argument("--energy-interval", type=float, default=5.0, help="seconds between energy samples")
    parser.add_argument("--max-rapl-power-w", type=float, default=DEFAULT_MAX_RAPL_POWER_W,
                        help="the most one RAPL zone can draw; a longer silence than its range holds at this "
                             "power is not trusted (as the accounting's flag of the same name; "
                             f"default {DEFAULT_MAX_RAPL_POWER_W:g})")


def default_cpu_threads(in_process: bool) -> int:
    """Every core for a core in its own process; one fewer when it shares the API process's GIL."""
    cores = os.cpu_count() or 1
    return max(1, cores - 1) if in_process else cores


def build_spec_config(args: argparse.Namespace) -> SpecConfig:
    """The speculative-decoding settings; a bad combination names its flag (ConfigError)."""
    if args.spec == "none":
        for flag, given in (("draft-tokens", args.draft_tokens is not None), ("draft-model", args.draft_model),
                            ("lm-head-draft", args.lm_head_draft)):
            if given:
                raise ConfigError(flag, "speculative decoding is off: add --spec ngram|draft|mtp")
    k = DEFAULT_DRAFT_TOKENS if args.draft_tokens is None else args.draft_tokens
    if not MIN_DRAFT_TOKENS <= k <= MAX_DRAFT_TOKENS:
        raise ConfigError("draft-tokens", f"speculative decoding takes {MIN_DRAFT_TOKENS}..{MAX_DRAFT_TOKENS} "
                                          f"draft tokens, got {k}")
    if args.spec == "draft" and args.draft_model is None:
        raise ConfigError("draft-model", "speculative decoding with --spec draft needs --draft-model PATH")
    if args.spec != "draft" and args.draft_model is not None:
        raise ConfigError("draft-model", f"speculative decoding uses --draft-model only with --spec draft, "
                                         f"not --spec {args.spec}")
    if args.spec == "ngram" and args.lm_head_draft:
        raise ConfigError("lm-head-draft", "speculative decoding with --spec ngram has no draft logits: "
                                           "--lm-head-draft applies to --spec draft or mtp")
    return SpecConfig(method=args.spec, num_draft_tokens=k, draft_model_path=args.draft_model,
                      lm_head_draft=args.lm_head_draft)


def _kv_capacity(text: str) -> int | None:
    """``--kv-capacity``: a token count, or ``auto`` (None: sized from free memory)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or 'auto', got {text!r}") from None


def _stream_interval(text: str) -> float:
    """``--stream-interval-ms``: milliseconds, 0 to 1000."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, got {text!r}") from None
    if not 0 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"expected 0 to 1000 milliseconds, got {text}")
    return value



def _budgets(text: str) -> tuple[int, int, int]:
    try:
        low, medium, high = (int(v) for v in text.split(","))
    except ValueError:
        raise ConfigError("reasoning-budget-tokens", f"must be three integers LOW,MEDIUM,HIGH, got {text!r}") from None
    if not 0 <= low <= medium <= high:
        raise ConfigError("reasoning-budget-tokens", f"must be 0 <= LOW <= MEDIUM <= HIGH, got {text!r}")
    return low, medium, high

def build_config(args: argparse.Namespace) -> tuple[EngineConfig, ServeConfig, WorkerConfig]:
    spec = build_spec_config(args)
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise ConfigError("device", f"expected cpu or cuda[:N], got {args.device!r}")
    for key, low in (("max_concurrency", 1), ("max_pending_requests", 0), ("max_context", 1), ("kv_capacity", 1)):
        value = getattr(args, key)
        if value is not None and value < low:
            raise ConfigError(key.replace("_", "-"), f"must be >= {low}, got {value}")
    if args.kv_capacity is not None and args.max_context is not None and args.kv_capacity < args.max_context:
        raise ConfigError("kv-capacity", f"{args.kv_capacity} tokens cannot hold one --max-context "
                                         f"{args.max_context} request: raise it or lower --max-context")
    if not 0 <= args.port <= 65535:
        raise ConfigError("port", f"must be 0..65535, got {args.port}")
    if args.electricity_rate < 0:
        raise ConfigError("electricity-rate", "must be >= 0")
    if not 0.1 <= args.heartbeat_interval <= 10:
        raise ConfigError("heartbeat-interval", "must be between 0.1 and 10 seconds")
    if args.energy_interval < 0.5:
        raise ConfigError("energy-interval", "must be >= 0.5 seconds")
    if not (math.isfinite(args.max_rapl_power_w) and args.max_rapl_power_w > 0):
        raise ConfigError("max-rapl-power-w", f"must be a finite number of watts > 0, got {args.max_rapl_power_w}")
    worker_id = args.worker_id or default_worker_id("engine")
    try:
        subjects.check_id(worker_id)
    except ValueError as exc:
        raise ConfigError("worker-id", str(exc)) from None
    path = Path(args.model_path)
    if path.is_file():
        path = materialize(path, data_dir(args.data_dir) / "ninfer-cache")
    model_id = args.model_id or Path(args.model_path).stem
    engine = EngineConfig(
        model_path=path, model_id=model_id, dtype=args.dtype, device=args.device, kv_dtype=args.kv_dtype,
        quant_dequant=args.quant_dequant, kv_capacity_tokens=args.kv_capacity, max_concurrency=args.max_concurrency,
        max_pending_requests=args.max_pending_requests, max_context=args.max_context,
        preserve_thinking=args.preserve_thinking, enable_thinking=not args.no_thinking,
        reasoning_effort=args.reasoning_effort, reasoning_budget_tokens=_budgets(args.reasoning_budget_tokens),
        spec=spec, backend=args.backend,
        stream_interval_ms=args.stream_interval_ms, cuda_graphs=not args.no_cuda_graphs,
        pooling=args.pooling,
        torch_threads=args.threads or (default_cpu_threads(args.in_process) if args.device == "cpu" else None),
    )
    try:
        select_backend(args.device, args.backend)  # a backend that cannot run here stops the start, named
    except BackendUnavailableError as exc:
        raise ConfigError("backend", exc.reason) from None
    serve = ServeConfig(host=args.host, port=args.port, api_key=args.api_key or None,
                        electricity_rate_usd_per_kwh=args.electricity_rate, metrics_state=args.metrics_state,
                        energy_interval_s=args.energy_interval, max_rapl_power_w=args.max_rapl_power_w)
    return engine, serve, WorkerConfig(worker_id=worker_id, heartbeat_interval_s=args.heartbeat_interval)


async def run(args: argparse.Namespace) -> None:
    engine_config, serve_config, worker_config = build_config(args)
    nats_url = args.nats or os.environ.get("NATS_URL")
    async with contextlib.AsyncExitStack() as stack:
        engine: EngineHandle
        if args.in_process:
            engine_core = await asyncio.to_thread(EngineCore, engine_config)
            log.info("%s", engine_core.describe())
            engine = await stack.enter_async_context(AsyncEngine(engine_core))
        else:
            process = await stack.enter_async_context(ProcessEngine(engine_config))
            log.info("%s (core in process %s)", process.description, process.pid)
            engine = process
        core = engine.core
        meter = detect_meter(engine_config.device)
        log.info("energy: %s", meter.describe())
        service = EngineService(engine, meter, serve_config, worker_id=worker_config.worker_id)
        stack.callback(meter.close)
        stack.callback(service.save_metrics_state)  # at shutdown, after requests stopped
        try:
            async with asyncio.TaskGroup() as tasks:
                url = await stack.enter_async_context(http_site(service))
                where = f"listening on {url} (model {core.model_id})"
                if nats_url:
                    nc = await connect(nats_url, f"engine:{worker_config.worker_id}")
                    stack.push_async_callback(drain_quietly, nc)
                    await ensure_bus(nc)
                    service.nc = nc
                    worker = BusWorker(nc, engine, worker_config)
                    tasks.create_task(worker.run())
                    where += f"; bus worker {worker_config.worker_id} on {subjects.gen(worker_config.worker_id)}"
                tasks.create_task(_stop_when_core_lost(engine))
                tasks.create_task(service.energy_loop())
                tasks.create_task(service.metrics_state_loop())
                announce("engine", where)
        except ExceptionGroup as group:  # core lost: one line and a non-zero exit, the supervisor starts us again
            lost = group.subgroup(CoreLostError)
            if lost is None:
                raise
            raise lost.exceptions[0] from None


async def _stop_when_core_lost(engine: EngineHandle) -> None:
    """An engine whose core process died serves nothing: stop (requests in flight have ended with
    ``abort``, new ones got 503) rather than keep heartbeating \"ready\" with no core behind it."""
    raise await engine.core_lost()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ninfer-serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging()
    run_async_main(lambda: run(args), "engine", clean_errors=(EngineError,))


if __name__ == "__main__":
    main()
