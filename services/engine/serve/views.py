"""The telemetry endpoints' bodies, in the interop shapes (shared/reference/interop.md). Pure: every
input, the clock included, is passed in.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from services.common.prom import (
    E2E_BUCKETS_S,
    INTER_TOKEN_BUCKETS_S,
    REQUEST_N_BUCKETS,
    TTFT_BUCKETS_S,
    Histogram,
    PromText,
    buckets_1_2_5,
)
from services.engine.outputs import EngineSnapshot, RequestOutput
from services.engine.serve.usage_ledger import UsageLedger
from services.engine.spec.spec_decode import SpecDecodeStats

# Token-count histograms are kept on vLLM's 1-2-5 buckets up to far past any context and written up to the
# engine's max context (vLLM bounds them by max_model_len): the 1-2-5 buckets up to any bound are a prefix of
# these, so the written histogram is exact.
_TOKEN_BUCKETS = buckets_1_2_5(10**9)
# The engine label vLLM v1 puts on every per-engine series (its data-parallel rank): one engine core here.
ENGINE_INDEX = "0"


@dataclass
class RequestStats:
    """Totals over finished requests since the process started (HTTP and bus alike), with vLLM's per-request
    histograms (vllm/v1/metrics/loggers.py: the same names, buckets and phase meanings; see
    outputs.RequestTimings). Per-step ones (tokens per step, inter-token gaps) are counted by the core and
    come in the EngineSnapshot."""

    finished: collections.Counter[str] = field(default_factory=collections.Counter)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS_S))
    queue: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS_S))  # arrival -> first scheduled
    inference: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS_S))  # first scheduled -> last token
    prefill: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS_S))  # first scheduled -> first token
    decode: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS_S))  # first token -> last token
    time_per_output_token: Histogram = field(default_factory=lambda: Histogram(INTER_TOKEN_BUCKETS_S))  # decode/(n-1)
    prompt_tokens: Histogram = field(default_factory=lambda: Histogram(_TOKEN_BUCKETS))
    generation_tokens: Histogram = field(default_factory=lambda: Histogram(_TOKEN_BUCKETS))
    max_tokens_param: Histogram = field(default_factory=lambda: Histogram(_TOKEN_BUCKETS))
    n_param: Histogram = field(default_factory=lambda: Histogram(REQUEST_N_BUCKETS))
    prompt_seconds: float = 0.0
    predicted_seconds: float = 0.0
    cached_prompt_tokens: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0

    def observe(self, output: RequestOutput) -> None:
        """Record a finished request (call once, with its final output)."""
        self.finished[output.finish_reason or "unknown"] += 1
        self.cached_prompt_tokens += output.num_cached_tokens
        self.num_prompt_tokens += output.num_prompt_tokens
        self.num_output_tokens += output.num_output_tokens
        self.prompt_tokens.observe(output.num_prompt_tokens)
        self.generation_tokens.observe(output.num_output_tokens)
        # each choice of an n > 1 request is an engine request of its own (serve/choices.py), observed as n=1
        self.n_param.observe(1)
        if output.max_tokens:
            self.max_tokens_param.observe(output.max_tokens)
        t = output.timings
        if t is None:
            return
        if t.ttft_ms is not None:
            self.ttft.observe(t.ttft_ms / 1000.0)
        queue_s, prefill_s, decode_s = t.queue_ms / 1000.0, t.prompt_ms / 1000.0, t.predicted_ms / 1000.0
        self.e2e.observe(queue_s + prefill_s + decode_s)
        self.queue.observe(queue_s)
        self.prefill.observe(prefill_s)
        self.decode.observe(decode_s)
        self.inference.observe(prefill_s + decode_s)
        # vLLM's mean_time_per_output_token: the decode phase over the tokens after the first (0 for one token)
        n = output.num_output_tokens
        self.time_per_output_token.observe(decode_s / (n - 1) if n > 1 else 0.0)
        self.prompt_seconds += prefill_s
        self.predicted_seconds += decode_s

    @property
    def num_requests(self) -> int:
        return sum(self.finished.values())


def slots_body(model_id: str, snap: EngineSnapshot) -> dict[str, Any]:
    s = snap.stats
    return {
        "model": model_id,
        "max_concurrency": snap.lanes,
        "requests_processing": s.num_running,
        "requests_waiting": s.num_waiting,
        "prefilling": s.num_prefilling,
        "decode_ready": s.num_decoding,
        "materializing": 0,
        "device_state_slots": {"occupied": s.num_running},
        "host_state_slots": {"occupied": 0},
        "kv_pages": {"main_occupied": s.num_kv_blocks_used, "backend_occupied": 0,
                     "total": s.num_kv_blocks_total},
        "slots": [{"id": i, "busy": i < s.num_running} for i in range(snap.lanes)],
    }


def _human(seconds: float) -> str:
    h, rem = divmod(int(seconds), 3600)
    return f"{h}h {rem // 60}m"


def usage_body(model_id: str, snap: EngineSnapshot, ledger: UsageLedger, day: str, uptime_s: float,
               window_s: float) -> dict[str, Any]:
    s = snap.stats
    queried, hit = s.num_prompt_tokens_queried, s.num_prompt_tokens_hit
    prompt_total, output_total = ledger.prompt_tokens_total, ledger.output_tokens_total
    body: dict[str, Any] = {
        "model": model_id,
        "uptime": {"seconds": round(uptime_s, 1), "human": _human(uptime_s)},
        "tokens": {
            "input": {
                "total": prompt_total,
                "cache_hits": ledger.cached_tokens_total,
                "cache_computed": prompt_total - ledger.cached_tokens_total,
                "cache_hit_rate_pct": round(100.0 * hit / queried, 2) if queried else 0.0,
            },
            "output": {"total": output_total},
            "total": prompt_total + output_total,
        },
        "throughput": {
            "window_seconds": window_s,
            "window_active": snap.prefill_tok_per_s > 0 or snap.decode_tok_per_s > 0,
            "prefill_tok_per_s": round(snap.prefill_tok_per_s, 2),
            "decode_tok_per_s": round(snap.decode_tok_per_s, 2),
            "prefill_tokens_last_window": round(snap.prefill_tok_per_s * window_s),
            "decode_tokens_last_window": round(snap.decode_tok_per_s * window_s),
        },
        "requests": {
            "total": snap.admitted_total,
            "cache_efficiency_pct": round(100.0 * hit / queried, 2) if queried else 0.0,
        },
        "lanes": {
            "capacity": snap.lanes,
            "processing": s.num_running,
            "waiting": s.num_waiting,
            "decoding": s.num_decoding,
            "prefilling": s.num_prefilling,
        },
        "health": {
            # This engine recomputes instead of spilling KV to host memory: spills stay 0 by design;
            # preemptions (recomputes) and prefix-cache evictions are the pressure signals.
            "kv_pressure_spills": 0,
            "sessions_evicted": s.num_preemptions_total,
            "kv_pages_occupied": s.num_kv_blocks_used,
            "kv_cache_evictions": s.num_evictions_total,
            "kv_usage": round(s.kv_usage, 4),
        },
        "energy": ledger.energy_view(day),
    }
    if snap.spec is not None:  # only when speculating: the interop shape has no such key
        body["speculative"] = speculative_view(snap.spec)
    return body


def speculative_view(spec: SpecDecodeStats) -> dict[str, Any]:
    """/usage's "speculative" section (present only while speculating): totals since start, with
    vLLM's meanings (see spec_decode.py)."""
    return {
        "enabled": True,
        "method": spec.method,
        "draft_tokens_per_step": spec.num_spec_tokens,
        "drafts": spec.num_drafts,
        "draft_tokens": spec.num_draft_tokens,
        "accepted_tokens": spec.num_accepted_tokens,
        "acceptance_rate_pct": round(100.0 * spec.acceptance_rate, 2),
        "mean_acceptance_length": round(spec.mean_acceptance_length, 3),
        "accepted_per_position": list(spec.num_accepted_tokens_per_pos),
    }


# The vLLM metric names this engine exports (the families as prometheus_client names them: a counter without
# ``_total``), from vllm/v1/metrics/loggers.py and what the official vLLM Grafana dashboard
# (examples/online_serving/prometheus_grafana/grafana.json) and the llm-d / production-stack routers read.
# tests/integration/test_observability.py checks every one is in a real engine's /metrics.
VLLM_METRIC_FAMILIES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:request_success",
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens",
    "vllm:request_params_max_tokens", "vllm:request_params_n", "vllm:iteration_tokens_total",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:cache_config_info",
)


def metrics_text(model_id: str, snap: EngineSnapshot, req: RequestStats, uptime_s: float,
                 energy_j_total: float | None, block_size: int, num_deadline_dropped: int = 0) -> str:
    s = snap.stats
    m = PromText()
    model = {"model_name": model_id, "engine": ENGINE_INDEX}  # vLLM v1's labels on every per-engine series
    # vLLM-compatible names.
    m.gauge("vllm:num_requests_running", "Requests in model execution batches.", s.num_running, model)
    m.gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", s.num_waiting, model)
    m.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage, model)
    # vLLM's name before v0.10; the production-stack router and older llm-d schedulers still read it
    m.gauge("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage, model)
    m.counter("vllm:prompt_tokens_total", "Prefill tokens processed.", snap.prompt_tokens_total, model)
    m.counter("vllm:generation_tokens_total", "Generation tokens processed.", snap.output_tokens_total, model)
    m.counter("vllm:prefix_cache_queries_total", "Prefix cache queries, in tokens.", s.num_prompt_tokens_queried,
              model)
    m.counter("vllm:prefix_cache_hits_total", "Prefix cache hits, in tokens.", s.num_prompt_tokens_hit, model)
    m.counter("vllm:num_preemptions_total", "Cumulative number of preemptions.", s.num_preemptions_total, model)
    for reason, n in sorted(req.finished.items()):
        m.counter("vllm:request_success_total", "Finished requests by finish reason.", n,
                  {**model, "finished_reason": reason})
    max_len = snap.max_context  # vLLM's max_model_len bounds its token-count buckets
    m.histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", req.prompt_tokens.up_to(max_len),
                model)
    m.histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                req.generation_tokens.up_to(max_len), model)
    # every engine request is one choice (n > 1: one request per choice), so the most generation tokens of a
    # request's choices is its generation tokens
    m.histogram("vllm:request_max_num_generation_tokens", "Maximum number of requested generation tokens.",
                req.generation_tokens.up_to(max_len), model)
    m.histogram("vllm:request_params_max_tokens", "The max_tokens request parameter.",
                req.max_tokens_param.up_to(max_len), model)
    m.histogram("vllm:request_params_n", "The n request parameter.", req.n_param, model)
    if snap.iteration_tokens is not None:
        m.histogram("vllm:iteration_tokens_total", "Tokens per engine step.", snap.iteration_tokens, model)
    m.histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", req.ttft, model)
    if snap.inter_token_latency is not None:
        m.histogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", snap.inter_token_latency,
                    model)
        # vLLM's name for the same observations before 0.11 (the official Grafana dashboard still reads it)
        m.histogram("vllm:time_per_output_token_seconds", "Time per output token in seconds (the inter-token "
                    "latency's older name).", snap.inter_token_latency, model)
    m.histogram("vllm:request_time_per_output_token_seconds", "Mean time per output token of each request "
                "(decode time / (generation tokens - 1)).", req.time_per_output_token, model)
    m.histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", req.e2e, model)
    m.histogram("vllm:request_queue_time_seconds", "Time spent in WAITING phase for request.", req.queue, model)
    m.histogram("vllm:request_inference_time_seconds", "Time spent in RUNNING phase for request.", req.inference,
                model)
    m.histogram("vllm:request_prefill_time_seconds", "Time spent in PREFILL phase for request.", req.prefill, model)
    m.histogram("vllm:request_decode_time_seconds", "Time spent in DECODE phase for request.", req.decode, model)
    if snap.spec is not None:
        spec = snap.spec
        # vLLM labels these with engine too; ours predate the engine label and readers match them as they are
        spec_labels = {"model_name": model_id}
        m.counter("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.", spec.num_drafts, spec_labels)
        m.counter("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.", spec.num_draft_tokens,
                  spec_labels)
        m.counter("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.",
                  spec.num_accepted_tokens, spec_labels)
        for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
            m.counter("vllm:spec_decode_num_accepted_tokens_per_pos_total", "Accepted tokens per draft position.",
                      n, {**spec_labels, "position": str(pos)})
    m.gauge("vllm:cache_config_info", "Information of the KV cache configuration.", 1,
            {"block_size": str(block_size), "num_gpu_blocks": str(s.num_kv_blocks_total),
             "enable_prefix_caching": "True", "max_num_seqs": str(snap.lanes),  # lanes, for vLLM-shaped readers
             "engine": ENGINE_INDEX})
    # llama.cpp / NInfer-fork names (the existing gateway reads these).
    m.counter("llamacpp:prompt_tokens_total", "Prompt tokens processed.", snap.prompt_tokens_total)
    m.counter("llamacpp:tokens_predicted_total", "Generation tokens processed.", snap.output_tokens_total)
    m.counter("llamacpp:prompt_cache_tokens_total", "Prompt tokens served from the prefix cache.",
              s.num_prompt_tokens_hit)
    m.gauge("llamacpp:requests_processing", "Requests processing.", s.num_running)
    m.gauge("llamacpp:requests_deferred", "Requests deferred (waiting).", s.num_waiting)
    m.gauge("llamacpp:kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage)
    m.gauge("llamacpp:kv_cache_tokens", "KV-cache tokens in use.", s.num_kv_blocks_used * block_size)
    m.gauge("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
            req.num_prompt_tokens / req.prompt_seconds if req.prompt_seconds > 0 else 0.0)
    m.gauge("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s.",
            req.num_output_tokens / req.predicted_seconds if req.predicted_seconds > 0 else 0.0)
    m.counter("ninfer:requests_total", "Requests admitted.", snap.admitted_total)
    m.counter("ninfer:requests_deadline_dropped_total",
              "Requests dropped because their deadline passed before they produced a token.", num_deadline_dropped)
    m.counter("ninfer:pressure_spill_pages_total", "KV pages spilled under pressure (this engine recomputes).", 0)
    m.counter("ninfer:kv_cache_evictions_total", "Cached prefix blocks evicted.", s.num_evictions_total)
    m.gauge("ninfer:process_uptime_seconds", "Seconds since the engine started.", uptime_s)
    m.gauge("ninfer:max_concurrency", "Lanes: requests that can run at once.", snap.lanes)
    m.counter("ninfer:energy_joules_total", "Measured device energy since start (absent when unavailable).",
              energy_j_total)
    return m.render()
