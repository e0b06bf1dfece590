"""Pure: what an engine answered (JSON bodies, parsed ``/metrics``) → one :class:`Reading` per scrape.

One normaliser per engine kind; each fills only what that engine says and leaves the rest None
("unknown", never a made-up 0). Field by field, docs/telemetry.md has the table; the shapes are in
shared/reference/interop.md. Bodies are foreign input: a wrong type reads as unknown, and a body that
cannot be the kind at all raises :class:`MalformedBody`.
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from proto.fleet import EngineKind
from services.telemetry.promparse import Exposition

WH_TO_MJ = 3.6e6  # 1 Wh = 3600 J = 3.6e6 mJ


class MalformedBody(ValueError):
    """A body that cannot be what the endpoint should answer (``endpoint`` names which)."""

    def __init__(self, endpoint: str, reason: str) -> None:
        super().__init__(f"{endpoint}: {reason}")
        self.endpoint = endpoint
        self.reason = reason


@dataclass(frozen=True)
class Reading:
    """What one scrape learned about a member; the SlotHeartbeat fields it could fill, plus energy.

    ``energy_wh_total`` is the sum of the engine's own per-day Wh figures (NInfer ``/usage``
    ``energy.daily``), None when it reported no day with a figure. ``energy_30d_wh`` is the engine's own
    ``energy.rolling_30d.wh`` as it reports it (None when absent or not a number, never 0).

    ``signal_sources`` names, per load field the engine filled, where it came from (``"/slots"``,
    ``"/metrics"``, ``"cache_config_info"`` ...); lanes the engine does not report are resolved later
    (lanes.py: declared, learned, default). ``process_start_s`` (``process_start_time_seconds``) and
    ``tokens_processed_total`` (prompt + generated tokens since the engine started) only tell a restart apart.
    """

    engine_kind: EngineKind
    model_id: str = ""
    lanes: int | None = None
    running: int | None = None
    waiting: int | None = None
    max_context: int | None = None
    kv_usage: float | None = None
    kv_blocks_used: int | None = None
    kv_blocks_total: int | None = None
    kv_spills_total: int | None = None
    kv_evictions_total: int | None = None
    preemptions_total: int | None = None
    admitted_total: int | None = None
    prompt_tokens_queried_total: int | None = None
    prompt_tokens_hit_total: int | None = None
    prefill_tok_per_s: float | None = None
    decode_tok_per_s: float | None = None
    energy_today_wh: float | None = None
    energy_wh_total: float | None = None
    energy_30d_wh: float | None = None
    kv_capacity_tokens: int | None = None
    signal_sources: Mapping[str, str] = field(default_factory=dict)
    process_start_s: float | None = None
    tokens_processed_total: int | None = None


@dataclass(frozen=True)
class EngineInfo:
    """What an engine says about itself once (llama.cpp ``/props``, SGLang ``/server_info``): read at
    detection, like ``/v1/models``. ``source`` is the endpoint that answered."""

    source: str
    lanes: int | None = None
    max_context: int | None = None
    kv_capacity_tokens: int | None = None
    model_id: str = ""


@dataclass(frozen=True)
class ModelsInfo:
    """From ``GET /v1/models``: served model ids and, where the server says (vLLM), the context limit."""

    model_ids: tuple[str, ...] = ()
    max_context: int | None = None

    @property
    def model_id(self) -> str:
        return self.model_ids[0] if self.model_ids else ""


# ---- typed access to foreign JSON ------------------------------------------------------------------


def _get(body: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(body, dict):
            return None
        body = body.get(key)
    return body


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, float) and math.isfinite(value) and value >= 0:
        return int(value)
    return None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _wh(value: Any) -> float | None:
    """An energy figure: a finite number of Wh, >= 0 (anything else is unknown, never 0)."""
    wh = _float(value)
    return wh if wh is not None and wh >= 0 else None


def _ratio(value: float | None) -> float | None:
    return None if value is None else min(max(value, 0.0), 1.0)


def _count(value: float | None) -> int | None:
    """A Prometheus gauge or counter read as a count (they are floats on the wire)."""
    return None if value is None or not math.isfinite(value) or value < 0 else round(value)


def _sourced(reading: Reading, **sources: str) -> Reading:
    """``reading`` with ``signal_sources`` naming each given field's source, for the fields it filled."""
    named = {name: source for name, source in sources.items() if getattr(reading, name) is not None}
    return replace(reading, signal_sources={**reading.signal_sources, **named})


def models_info(body: Any) -> ModelsInfo:
    """An OpenAI ``GET /v1/models`` body; raises MalformedBody when it is not one."""
    data = _get(body, "data")
    if not isinstance(data, list):
        raise MalformedBody("/v1/models", "no 'data' list")
    ids = tuple(m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str))
    lengths = [n for m in data if (n := _int(_get(m, "max_model_len")))]
    return ModelsInfo(ids, min(lengths) if lengths else None)


# ---- NInfer-class: /slots + /usage ----------------------------------------------------------------


def is_ninfer_slots(body: Any) -> bool:
    """interop.md: a backend is NInfer-class when ``/slots`` is an object with a non-zero ``max_concurrency``."""
    return bool(_int(_get(body, "max_concurrency")))


def daily_wh_total(usage: Any) -> float | None:
    """Sum of the non-null ``energy.daily[*].wh``; None when no day has a figure.

    The engine keeps ~31 UTC days, so the sum only grows while days fill and shrinks when the oldest
    day is pruned (or the engine loses its metrics state): the accounting treats a shrinking counter
    as a reset and flags that interval instead of guessing.
    """
    daily = _get(usage, "energy", "daily")
    if not isinstance(daily, dict):
        return None
    figures = [wh for day in daily.values() if (wh := _wh(_get(day, "wh"))) is not None]
    return math.fsum(figures) if figures else None


def ninfer_reading(slots: Any, usage: Any | None) -> Reading:
    """``/slots`` (required: lanes, running, waiting, KV pages) and ``/usage`` (optional: counters,
    throughput, energy). ``health.sessions_evicted`` is the fork's KV eviction count."""
    if not is_ninfer_slots(slots):
        raise MalformedBody("/slots", "not an NInfer /slots object (no non-zero max_concurrency)")
    used = _int(_get(slots, "kv_pages", "main_occupied"))
    total = _int(_get(slots, "kv_pages", "total"))
    kv_usage = _ratio(_float(_get(usage, "health", "kv_usage")))
    if kv_usage is None and used is not None and total:
        kv_usage = _ratio(used / total)
    model = _get(slots, "model") or _get(usage, "model")
    kv_source = "/usage" if _float(_get(usage, "health", "kv_usage")) is not None else "/slots"
    return _sourced(Reading(
        engine_kind="ninfer",
        model_id=model if isinstance(model, str) else "",
        lanes=_int(slots["max_concurrency"]),
        running=_int(_get(slots, "requests_processing")),
        waiting=_int(_get(slots, "requests_waiting")),
        kv_usage=kv_usage,
        kv_blocks_used=used,
        kv_blocks_total=total or None,
        kv_spills_total=_int(_get(usage, "health", "kv_pressure_spills")),
        kv_evictions_total=_int(_get(usage, "health", "sessions_evicted")),
        admitted_total=_int(_get(usage, "requests", "total")),
        prompt_tokens_queried_total=_int(_get(usage, "tokens", "input", "total")),
        prompt_tokens_hit_total=_int(_get(usage, "tokens", "input", "cache_hits")),
        prefill_tok_per_s=_float(_get(usage, "throughput", "prefill_tok_per_s")),
        decode_tok_per_s=_float(_get(usage, "throughput", "decode_tok_per_s")),
        energy_today_wh=_float(_get(usage, "energy", "today", "wh")),
        energy_30d_wh=_wh(_get(usage, "energy", "rolling_30d", "wh")),
        energy_wh_total=daily_wh_total(usage),
    ), lanes="/slots", running="/slots", waiting="/slots", kv_usage=kv_source)


# ---- Prometheus-speaking engines ------------------------------------------------------------------

# Families each kind's normaliser reads: everything else (histogram buckets above all) is skipped unparsed.
VLLM_FAMILIES = frozenset({
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:cache_config_info", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
})
LLAMACPP_FAMILIES = frozenset({
    "llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:kv_cache_usage_ratio",
    "llamacpp:kv_cache_tokens", "llamacpp:prompt_tokens_total", "llamacpp:prompt_cache_tokens_total",
    "llamacpp:prompt_tokens_seconds", "llamacpp:predicted_tokens_seconds", "llamacpp:tokens_predicted_total",
})
SGLANG_FAMILIES = frozenset({
    "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:max_running_requests",
    "sglang:max_total_num_tokens", "sglang:num_used_tokens", "sglang:gen_throughput", "sglang:context_len",
    "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
})
# prometheus_client's process collector (vLLM and SGLang run one unless in multiprocess mode): a new value
# is a new process, so what telemetry learned about the old one is forgotten (lanes.py).
PROCESS_START = "process_start_time_seconds"
_KINDS_BY_PREFIX: tuple[tuple[str, EngineKind], ...] = (("vllm:", "vllm"), ("sglang:", "sglang"),
                                                         ("llamacpp:", "llamacpp"))


def wanted_family(name: str) -> bool:
    """The ``keep`` for :func:`promparse.parse`: the families some normaliser reads (with or without
    ``_total``, as exporters differ)."""
    if name.startswith("vllm:"):
        return name in VLLM_FAMILIES or name + "_total" in VLLM_FAMILIES
    if name.startswith("llamacpp:"):
        return name in LLAMACPP_FAMILIES or name + "_total" in LLAMACPP_FAMILIES
    if name.startswith("sglang:"):
        return name in SGLANG_FAMILIES or name + "_total" in SGLANG_FAMILIES
    return name == PROCESS_START


def metrics_kind(metrics: Exposition) -> EngineKind | None:
    """The engine kind a ``/metrics`` body speaks for, by its metric prefix; None for anything else.

    Order matters: NInfer forks (and our engine) also export ``llamacpp:*``, and our engine exports
    ``vllm:*`` too, which is why ``/slots`` is asked first (scraper.py).
    """
    for prefix, kind in _KINDS_BY_PREFIX:
        if metrics.has_prefix(prefix):
            return kind
    return None


def _label_ints(metrics: Exposition, family: str, label: str) -> list[int]:
    """The integer values of ``label`` over a family's samples (one per vLLM engine for ``cache_config_info``)."""
    out = []
    for sample in metrics.samples(family):
        value = sample.labels.get(label)
        if value is not None and value.isdigit():
            out.append(int(value))
    return out


def _label_total(metrics: Exposition, family: str, label: str) -> int | None:
    """Sum over engines (data parallel: each engine has its own blocks and lanes); None when none says."""
    values = _label_ints(metrics, family, label)
    return sum(values) if values else None


def _model_label(metrics: Exposition, *families: str) -> str:
    for family in families:
        for sample in metrics.samples(family):
            name = sample.labels.get("model_name")
            if name:
                return name
    return ""


def _process_start_s(metrics: Exposition) -> float | None:
    found = metrics.samples(PROCESS_START)
    value = found[0].value if found else None
    return value if value is not None and math.isfinite(value) and value > 0 else None


def _tokens_total(metrics: Exposition, *names: str) -> int | None:
    """Prompt + generated tokens since the engine started: a counter that only a restart takes down."""
    counts = [_count(metrics.total(name)) for name in names]
    known = [c for c in counts if c is not None]
    return sum(known) if known else None


def vllm_reading(metrics: Exposition, models: ModelsInfo) -> Reading:
    """vLLM ``/metrics``. Lanes (max_num_seqs) only when ``cache_config_info`` carries it (our engine and
    patched builds do; upstream vLLM's CacheConfig has no such field): lanes.py supplies the rest."""
    running = metrics.total("vllm:num_requests_running")
    if running is None:
        raise MalformedBody("/metrics", "no vllm:num_requests_running")
    kv_usage = _ratio(metrics.mean("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"))
    blocks_total = _label_total(metrics, "vllm:cache_config_info", "num_gpu_blocks")
    block_sizes = _label_ints(metrics, "vllm:cache_config_info", "block_size")
    block_size = block_sizes[0] if block_sizes else None
    return _sourced(Reading(
        engine_kind="vllm",
        model_id=_model_label(metrics, "vllm:num_requests_running") or models.model_id,
        lanes=_label_total(metrics, "vllm:cache_config_info", "max_num_seqs") or None,
        running=_count(running),
        waiting=_count(metrics.total("vllm:num_requests_waiting")),
        max_context=models.max_context,
        kv_usage=kv_usage,
        kv_blocks_used=round(kv_usage * blocks_total) if kv_usage is not None and blocks_total else None,
        kv_blocks_total=blocks_total or None,
        kv_capacity_tokens=(blocks_total * block_size) if blocks_total and block_size else None,
        preemptions_total=_count(metrics.total("vllm:num_preemptions_total")),
        prompt_tokens_queried_total=_count(metrics.total("vllm:prefix_cache_queries_total",
                                                         "vllm:gpu_prefix_cache_queries_total")),
        prompt_tokens_hit_total=_count(metrics.total("vllm:prefix_cache_hits_total",
                                                     "vllm:gpu_prefix_cache_hits_total")),
        process_start_s=_process_start_s(metrics),
        tokens_processed_total=_tokens_total(metrics, "vllm:prompt_tokens_total", "vllm:generation_tokens_total"),
    ), lanes="cache_config_info", running="/metrics", waiting="/metrics", kv_usage="/metrics",
        kv_capacity_tokens="cache_config_info", max_context="/v1/models")


# ---- llama.cpp: /slots, /props, /metrics ------------------------------------------------------------


def _llamacpp_slot_busy(slot: Any) -> bool | None:
    busy = _get(slot, "is_processing")
    if isinstance(busy, bool):
        return busy
    state = _get(slot, "state")  # older builds: 0 idle, 1 processing
    if isinstance(state, int) and not isinstance(state, bool):
        return state != 0
    return None


def is_llamacpp_props(body: Any) -> bool:
    """llama.cpp's ``GET /props``: an object with a positive ``total_slots`` (its ``--parallel``) and a
    ``default_generation_settings`` object. Every build since slots existed answers it (``--no-slots`` only
    switches ``/slots`` off: 501 ``not_supported_error``)."""
    return bool(_int(_get(body, "total_slots"))) and isinstance(_get(body, "default_generation_settings"), dict)


def llamacpp_props(body: Any) -> EngineInfo:
    """``/props``: lanes = ``total_slots``; context = ``default_generation_settings.n_ctx`` (one slot's
    context, what a request may use); model = ``model_alias`` (newer builds), else the file name of
    ``model_path``. Raises MalformedBody when it is not llama.cpp's ``/props``."""
    if not is_llamacpp_props(body):
        raise MalformedBody("/props", "not llama.cpp /props (no positive total_slots)")
    alias = _get(body, "model_alias")
    path = _get(body, "model_path")
    model = alias if isinstance(alias, str) and alias else (
        posixpath.basename(path.replace("\\", "/")) if isinstance(path, str) else "")
    return EngineInfo(source="/props", lanes=_int(body["total_slots"]),
                      max_context=_int(_get(body, "default_generation_settings", "n_ctx")) or None, model_id=model)


def llamacpp_reading(slots: Any | None, metrics: Exposition | None, models: ModelsInfo,
                     props: EngineInfo | None = None) -> Reading:
    """llama.cpp: ``/slots`` (a JSON array; one entry per lane), ``/props`` (read at detection:
    ``total_slots``, for servers started with ``--no-slots``) and ``/metrics`` (``llamacpp:*``, only with
    ``--metrics``). The slots array wins for lanes and running; any one of them is enough to detect it."""
    lanes = running = max_context = None
    if slots is not None:
        if not isinstance(slots, list) or not slots:
            raise MalformedBody("/slots", "llama.cpp /slots is a non-empty JSON array")
        busy = [_llamacpp_slot_busy(s) for s in slots]
        lanes = len(slots)
        running = None if None in busy else sum(1 for b in busy if b)
        contexts = [n for s in slots if (n := _int(_get(s, "n_ctx")))]
        max_context = min(contexts) if contexts else None  # each slot holds its own context
    sources = {"lanes": "/slots", "running": "/slots", "max_context": "/slots"}
    m = metrics
    if m is not None and running is None:
        running = _count(m.total("llamacpp:requests_processing"))
        sources["running"] = "/metrics"
    if props is not None and lanes is None:
        lanes, sources["lanes"] = props.lanes, "/props"
    if max_context is None:
        if props is not None and props.max_context:
            max_context, sources["max_context"] = props.max_context, "/props"
        else:
            max_context, sources["max_context"] = models.max_context, "/v1/models"
    return _sourced(Reading(
        engine_kind="llamacpp",
        model_id=models.model_id or (props.model_id if props is not None else ""),
        lanes=lanes,
        running=running,
        waiting=_count(m.total("llamacpp:requests_deferred")) if m is not None else None,
        max_context=max_context,
        kv_usage=_ratio(m.mean("llamacpp:kv_cache_usage_ratio")) if m is not None else None,
        # llama.cpp's KV unit is a token (a block of size 1)
        kv_blocks_used=_count(m.total("llamacpp:kv_cache_tokens")) if m is not None else None,
        prompt_tokens_queried_total=_count(m.total("llamacpp:prompt_tokens_total")) if m is not None else None,
        prompt_tokens_hit_total=_count(m.total("llamacpp:prompt_cache_tokens_total")) if m is not None else None,
        prefill_tok_per_s=m.total("llamacpp:prompt_tokens_seconds") if m is not None else None,
        decode_tok_per_s=m.total("llamacpp:predicted_tokens_seconds") if m is not None else None,
        tokens_processed_total=_tokens_total(m, "llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total")
        if m is not None else None,
    ), **sources, waiting="/metrics", kv_usage="/metrics")


# ---- SGLang: /metrics (--enable-metrics) and /server_info -------------------------------------------


def _sum_ints(items: Any, *path: str) -> int | None:
    """Σ ``path`` over a list of objects (SGLang's ``internal_states``, one per data-parallel rank); None
    unless every item has a count."""
    if not isinstance(items, list) or not items:
        return None
    values = [_int(_get(item, *path)) for item in items]
    return None if None in values else sum(v for v in values if v is not None)


def sglang_server_info(body: Any, source: str) -> EngineInfo:
    """SGLang ``GET /server_info`` (older builds ``/get_server_info``, still answered with a deprecation
    warning): its server arguments, the scheduler's start-up figures and per-DP ``internal_states`` merged
    into one object. Lanes = Σ ``internal_states[].effective_max_running_requests_per_dp`` (the value after
    SGLang resolved the ``--max-running-requests`` it was given or not), else the top-level
    ``max_running_requests`` when the operator set it; KV capacity = ``max_total_num_tokens`` (the
    scheduler's, in tokens); context = ``context_length`` when set. Raises MalformedBody for a non-object."""
    if not isinstance(body, dict):
        raise MalformedBody(source, "not an SGLang server info object")
    states = body.get("internal_states")
    lanes = _sum_ints(states, "effective_max_running_requests_per_dp") or _int(body.get("max_running_requests"))
    capacity = _int(body.get("max_total_num_tokens")) or _sum_ints(states, "memory_usage", "token_capacity")
    served, path = body.get("served_model_name"), body.get("model_path")
    name = served if isinstance(served, str) and served else path if isinstance(path, str) else ""
    return EngineInfo(source=source, lanes=lanes or None, max_context=_int(body.get("context_length")) or None,
                      kv_capacity_tokens=capacity or None, model_id=name)


def sglang_reading(metrics: Exposition, models: ModelsInfo, info: EngineInfo | None = None) -> Reading:
    """SGLang ``/metrics``: running/queued requests and token usage (its KV occupancy, 0..1); lanes, KV
    capacity and context from the metrics where this build exports them (older builds:
    ``sglang:max_running_requests``, ``sglang:context_len``), else from its server info (``info``)."""
    running = metrics.total("sglang:num_running_reqs")
    if running is None:
        raise MalformedBody("/metrics", "no sglang:num_running_reqs")
    sources = {"lanes": "/metrics", "kv_capacity_tokens": "/metrics", "max_context": "/metrics"}
    lanes = _count(metrics.total("sglang:max_running_requests")) or None
    capacity_tokens = _count(metrics.total("sglang:max_total_num_tokens")) or None
    max_context = _count(metrics.total("sglang:context_len")) or None
    if info is not None:
        if lanes is None:
            lanes, sources["lanes"] = info.lanes, info.source
        if capacity_tokens is None:
            capacity_tokens, sources["kv_capacity_tokens"] = info.kv_capacity_tokens, info.source
        if max_context is None and info.max_context:
            max_context, sources["max_context"] = info.max_context, info.source
    if max_context is None:
        max_context, sources["max_context"] = models.max_context, "/v1/models"
    return _sourced(Reading(
        engine_kind="sglang",
        model_id=_model_label(metrics, "sglang:num_running_reqs") or models.model_id or (
            info.model_id if info is not None else ""),
        lanes=lanes,
        running=_count(running),
        waiting=_count(metrics.total("sglang:num_queue_reqs")),
        max_context=max_context,
        kv_usage=_ratio(metrics.mean("sglang:token_usage")),
        kv_blocks_used=_count(metrics.total("sglang:num_used_tokens")),
        kv_blocks_total=capacity_tokens,
        kv_capacity_tokens=capacity_tokens,  # its blocks are tokens
        decode_tok_per_s=metrics.total("sglang:gen_throughput"),
        process_start_s=_process_start_s(metrics),
        tokens_processed_total=_tokens_total(metrics, "sglang:prompt_tokens_total", "sglang:generation_tokens_total"),
    ), **sources, running="/metrics", waiting="/metrics", kv_usage="/metrics")


def stock_reading(models: ModelsInfo) -> Reading:
    """Reachable, and nothing more: every load field stays None (the router's "no signal")."""
    return Reading(engine_kind="stock", model_id=models.model_id, max_context=models.max_context)


def with_model(reading: Reading, models: ModelsInfo) -> Reading:
    """Fill the model id from ``/v1/models`` when the engine's own bodies did not name it."""
    return reading if reading.model_id or not models.model_id else replace(reading, model_id=models.model_id)
