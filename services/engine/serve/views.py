"""The telemetry endpoints' bodies, in the interop shapes (shared/reference/interop.md). Pure: every
input, the clock included, is passed in.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from services.common.prom import E2E_BUCKETS_S, TTFT_BUCKETS_S, Histogram, PromText
from services.engine.outputs import EngineSnapshot, RequestOutput
from services.engine.serve.usage_ledger import UsageLedger
from services.engine.spec.spec_decode import SpecDecodeStats


@dataclass
class RequestStats:
    """Totals over finished requests since the process started (HTTP and bus alike)."""

    finished: collections.Counter[str] = field(default_factory=collections.Counter)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS_S))
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
        t = output.timings
        if t is None:
            return
        if t.ttft_ms is not None:
            self.ttft.observe(t.ttft_ms / 1000.0)
        self.e2e.observe((t.queue_ms + t.prompt_ms + t.predicted_ms) / 1000.0)
        self.prompt_seconds += t.prompt_ms / 1000.0
        self.predicted_seconds += t.predicted_ms / 1000.0

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


def metrics_text(model_id: str, snap: EngineSnapshot, req: RequestStats, uptime_s: float,
                 energy_j_total: float | None, block_size: int, num_deadline_dropped: int = 0) -> str:
    s = snap.stats
    m = PromText()
    model = {"model_name": model_id}
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
    m.histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", req.ttft, model)
    m.histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", req.e2e, model)
    if snap.spec is not None:
        spec = snap.spec
        m.counter("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.", spec.num_drafts, model)
        m.counter("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.", spec.num_draft_tokens,
                  model)
        m.counter("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.",
                  spec.num_accepted_tokens, model)
        for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
            m.counter("vllm:spec_decode_num_accepted_tokens_per_pos_total", "Accepted tokens per draft position.",
                      n, {**model, "position": str(pos)})
    m.gauge("vllm:cache_config_info", "Information of the KV cache configuration.", 1,
            {"block_size": str(block_size), "num_gpu_blocks": str(s.num_kv_blocks_total),
             "enable_prefix_caching": "True", "max_num_seqs": str(snap.lanes)})  # lanes, for vLLM-shaped readers
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
