"""What real engines answer, byte for byte in shape (values made up): shared by the unit tests of the
normalisers and the integration tests' fixture servers. Shapes: shared/reference/interop.md."""

from __future__ import annotations

from typing import Any


def prom_label(value: str) -> str:
    r'''A label value as the text format writes it: ``\`` → ``\\``, ``"`` → ``\"``, newline → ``\n``.'''
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# A served model name as an operator may spell it (--served-model-name takes any string): quotes, a
# backslash, a comma and braces, all of which a line-regex "parser" gets wrong.
MESSY_MODEL_NAME = 'acme/"fast", {8B} \\ fp8'

# vLLM v1 (prometheus_client exposition: counters declared as *_total with a *_created gauge beside them,
# labelled by model_name and engine; real ones have dozens of buckets per histogram; cache_config_info carries
# the CacheConfig's fields and no max_num_seqs, vllm/v1/metrics/loggers.py log_metrics_info), plus what other
# exporters in the same process write: free comments and blank lines, a timestamp, and one counter in the
# OpenMetrics style (TYPE names it without _total, its samples carry _total and _created). The
# backslash-newlines only keep the source short: the string holds one line per sample.
_VLLM_TEMPLATE = '''# A free comment, not a declaration: "quotes", {braces}, a \\ backslash and a # sign
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 1234.0
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds @START@

# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="@MODEL@"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="@MODEL@"} 2.0 1700000000000
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="@MODEL@"} @KV@
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="@MODEL@"} 1000.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="@MODEL@"} 1.7e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="@MODEL@"} 250.0
# HELP vllm:num_preemptions Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="@MODEL@"} 7.0
vllm:num_preemptions_created{engine="0",model_name="@MODEL@"} 1.7e+09
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="@MODEL@"} @PROMPT@
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="@MODEL@"} 700.0

# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="@MODEL@"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.005",model_name="@MODEL@"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="@MODEL@"} 10.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="@MODEL@"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="@MODEL@"} 0.75
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",\
enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",\
num_cpu_blocks="None",num_gpu_blocks="2000",num_gpu_blocks_override="None",prefix_caching_hash_algo="builtin",\
sliding_window="None",swap_space="4"} 1.0
'''


def vllm_metrics(*, model_name: str = "Qwen/Qwen3-8B", kv_usage: str = "0.4", running: int = 3, waiting: int = 2,
                 start_s: float = 1.7e9, prompt_tokens: float = 5000.0) -> str:
    '''A vLLM ``/metrics`` body; ``kv_usage`` is written as given (``"NaN"`` is what a gauge with no
    value yet exports); ``start_s`` is the process's ``process_start_time_seconds``.'''
    return (_VLLM_TEMPLATE.replace("@MODEL@", prom_label(model_name)).replace("@KV@", kv_usage)
            .replace("} 3.0\n# HELP vllm:num_requests_waiting", f"}} {running:.1f}\n# HELP vllm:num_requests_waiting")
            .replace("} 2.0 1700000000000", f"}} {waiting:.1f} 1700000000000")
            .replace("@START@", repr(start_s)).replace("@PROMPT@", repr(prompt_tokens)))


VLLM_METRICS = vllm_metrics()

# An older vLLM (v0): gpu_cache_usage_perc and gpu_prefix_cache_* names, no engine label, max_num_seqs
# put into cache_config_info by a patched build.
VLLM_OLD_METRICS = '''# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="llama"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="llama"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="llama"} 0.05
# TYPE vllm:gpu_prefix_cache_queries counter
vllm:gpu_prefix_cache_queries{model_name="llama"} 40
# TYPE vllm:gpu_prefix_cache_hits counter
vllm:gpu_prefix_cache_hits{model_name="llama"} 10
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",max_num_seqs="128",num_gpu_blocks="1000"} 1.0
'''

VLLM_MODELS = {"object": "list", "data": [{"id": "Qwen/Qwen3-8B", "object": "model", "owned_by": "vllm",
                                           "max_model_len": 32768}]}

LLAMACPP_METRICS = '''# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 900
# HELP llamacpp:prompt_seconds_total Prompt process time
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 1.5
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 300
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s.
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 600
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s.
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 42.5
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.25
# HELP llamacpp:kv_cache_tokens KV-cache tokens.
# TYPE llamacpp:kv_cache_tokens gauge
llamacpp:kv_cache_tokens 1024
# HELP llamacpp:requests_processing Number of request processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of request deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
'''


def llamacpp_slots(busy: list[bool], *, old: bool = False) -> list[dict[str, Any]]:
    """A llama.cpp ``/slots`` array: ``is_processing`` (current builds) or ``state`` 0|1 (older ones)."""
    out = []
    for i, b in enumerate(busy):
        slot: dict[str, Any] = {"id": i, "n_ctx": 4096, "speculative": False,
                                "params": {"n_predict": -1, "temperature": 0.8}, "prompt": "",
                                "next_token": {"has_next_token": b, "n_remain": -1, "n_decoded": 0}}
        if old:
            slot.update({"task_id": 3 if b else -1, "state": 1 if b else 0})
        else:
            slot.update({"id_task": 3 if b else -1, "is_processing": b})
        out.append(slot)
    return out


LLAMACPP_MODELS = {"object": "list", "data": [{"id": "qwen2.5-7b-q4_k_m.gguf", "object": "model",
                                               "owned_by": "llamacpp", "meta": {"n_ctx_train": 32768}}]}

# SGLang (prometheus_client, labelled by model_name), with a free comment, a blank line, an OpenMetrics-style
# counter (TYPE without _total, samples with it) and a histogram whose _sum comes before its buckets.
_SGLANG_TEMPLATE = '''# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="@MODEL@"} 5.0
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{model_name="@MODEL@"} 6000.0

# free comment: {model_name="not a sample"} 99
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="@MODEL@"} @KV@
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="@MODEL@"} 312.5
# HELP sglang:prompt_tokens Number of prefill tokens processed.
# TYPE sglang:prompt_tokens counter
sglang:prompt_tokens_total{model_name="@MODEL@"} 12345.0
sglang:prompt_tokens_created{model_name="@MODEL@"} 1.7e+09
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="@MODEL@"} 4.0
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="@MODEL@"} 0.5
# HELP sglang:e2e_request_latency_seconds Histogram of End-to-end request latency in seconds
# TYPE sglang:e2e_request_latency_seconds histogram
sglang:e2e_request_latency_seconds_sum{model_name="@MODEL@"} 10.0
sglang:e2e_request_latency_seconds_bucket{le="0.1",model_name="@MODEL@"} 0.0
sglang:e2e_request_latency_seconds_bucket{le="+Inf",model_name="@MODEL@"} 8.0
sglang:e2e_request_latency_seconds_count{model_name="@MODEL@"} 8.0
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="@MODEL@"} 40000.0
'''


def sglang_metrics(*, model_name: str = "meta-llama/Llama-3.1-8B-Instruct", token_usage: str = "0.15",
                   running: int = 5, queued: int = 4) -> str:
    '''An SGLang ``/metrics`` body; ``token_usage`` (its KV occupancy) is written as given, ``"NaN"`` included.'''
    return (_SGLANG_TEMPLATE.replace("@MODEL@", prom_label(model_name)).replace("@KV@", token_usage)
            .replace('"} 5.0\n# HELP sglang:num_used_tokens', f'"}} {running:.1f}\n# HELP sglang:num_used_tokens')
            .replace('"} 4.0\n# HELP sglang:cache_hit_rate', f'"}} {queued:.1f}\n# HELP sglang:cache_hit_rate'))


SGLANG_METRICS = sglang_metrics()


def ninfer_slots(running: int = 2, waiting: int = 0, lanes: int = 8, model: str = "qwen3.8-27b") -> dict[str, Any]:
    """The NInfer fork's ``/slots`` (interop.md), with ``running`` busy lanes."""
    return {"model": model, "max_concurrency": lanes, "requests_processing": running, "requests_waiting": waiting,
            "prefilling": 0, "decode_ready": running, "materializing": 0,
            "device_state_slots": {"occupied": running}, "host_state_slots": {"occupied": 0},
            "kv_pages": {"main_occupied": 123, "backend_occupied": 0},
            "slots": [{"id": i, "busy": i < running} for i in range(lanes)]}


def _bucket(wh: float | None, tokens: int) -> dict[str, Any]:
    kwh = None if wh is None else wh / 1000
    return {"wh": wh, "kwh": kwh, "cost_usd": None if kwh is None else kwh * 0.125, "tokens": tokens,
            "cost_per_m_tokens_usd": None}


_SUM_OF_DAYS: Any = object()


def ninfer_usage(daily_wh: dict[str, float | None] | None = None, running: int = 2, waiting: int = 0,
                 spills: int = 0, evicted: int = 0, rolling_30d_wh: float | None = _SUM_OF_DAYS) -> dict[str, Any]:
    """The NInfer fork's ``/usage`` (interop.md); ``daily_wh`` maps UTC days to Wh (None: not measured).

    ``rolling_30d_wh`` defaults to the sum of the measured days (None when none was measured), as the
    engine computes it over its last 30 days; pass a figure to tell the fields apart in a test."""
    daily = {d: _bucket(wh, 100) for d, wh in (daily_wh or {}).items()}
    today = list(daily.values())[-1] if daily else _bucket(None, 0)
    if rolling_30d_wh is _SUM_OF_DAYS:
        measured = [wh for wh in (daily_wh or {}).values() if wh is not None]
        rolling_30d_wh = sum(measured) if measured else None
    rolling_30d = _bucket(rolling_30d_wh, 100 * len(daily))
    return {
        "model": "qwen3.8-27b", "uptime": {"seconds": 1234.5, "human": "0h 20m"},
        "tokens": {"input": {"total": 5000, "cache_hits": 1500, "cache_computed": 3500, "cache_hit_rate_pct": 30.0},
                   "output": {"total": 700}, "total": 5700},
        "throughput": {"window_seconds": 5.0, "window_active": True, "prefill_tok_per_s": 800.5,
                       "decode_tok_per_s": 55.25, "prefill_tokens_last_window": 4002, "decode_tokens_last_window": 276},
        "requests": {"total": 42, "cache_efficiency_pct": 30.0},
        "lanes": {"capacity": 8, "processing": running, "waiting": waiting, "decoding": running, "prefilling": 0},
        "health": {"kv_pressure_spills": spills, "sessions_evicted": evicted, "kv_pages_occupied": 123},
        "energy": {"rate_usd_per_kwh": 0.125, "today": today, "rolling_30d": rolling_30d, "daily": daily,
                   "note": "NVML energy counter"},
    }


# llama.cpp (tools/server): GET /props — every build answers it, --no-slots only switches /slots off
# (501 not_supported_error); /metrics answers the same way without --metrics.
def llamacpp_props(total_slots: int = 4, n_ctx: int = 8192, *, alias: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": n_ctx, "speculative": False,
                                        "is_processing": False,
                                        "params": {"n_predict": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95,
                                                   "samplers": ["top_k", "top_p", "min_p", "temperature"]},
                                        "prompt": "", "next_token": {"has_next_token": True, "n_remain": -1}},
        "total_slots": total_slots,
        "model_path": "/models/qwen2.5-7b-instruct-q4_k_m.gguf",
        "modalities": {"vision": False, "audio": False},
        "endpoint_slots": False, "endpoint_props": False, "endpoint_metrics": True,
        "chat_template": "{% for message in messages %}...{% endfor %}",
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "build_info": "b6123-abcdef0",
    }
    if alias is not None:  # newer builds: --alias (model_alias)
        body["model_alias"] = alias
    return body


LLAMACPP_SLOTS_OFF = {"error": {"code": 501, "message": "This server does not support slots endpoint. Start it with "
                                                        "`--slots`", "type": "not_supported_error"}}
LLAMACPP_METRICS_OFF = {"error": {"code": 501, "message": "This server does not support metrics endpoint. Start it "
                                                          "with `--metrics`", "type": "not_supported_error"}}


def sglang_server_info(*, max_running_per_dp: tuple[int, ...] = (48,), operator_max_running: int | None = None,
                       max_total_num_tokens: int = 40000, context_length: int | None = None) -> dict[str, Any]:
    """SGLang's ``GET /server_info`` (entrypoints/http_server.py): its ServerArgs as a dict, the scheduler's
    start-up figures and one ``internal_states`` entry per data-parallel rank, merged into one object."""
    args = {"model_path": "meta-llama/Llama-3.1-8B-Instruct", "tokenizer_path": "meta-llama/Llama-3.1-8B-Instruct",
            "served_model_name": "meta-llama/Llama-3.1-8B-Instruct", "context_length": context_length,
            "max_running_requests": operator_max_running, "max_queued_requests": None, "max_total_tokens": None,
            "chunked_prefill_size": 8192, "max_prefill_tokens": 16384, "schedule_policy": "fcfs",
            "mem_fraction_static": 0.88, "tp_size": 1, "dp_size": len(max_running_per_dp), "enable_metrics": True,
            "host": "0.0.0.0", "port": 30000, "api_key": None}
    return {
        **args, "status": "ready", "max_total_num_tokens": max_total_num_tokens, "max_req_input_len": 32762,
        "internal_states": [{**args, "last_gen_throughput": 312.5, "memory_usage": {
            "weight": 15.1, "kvcache": 4.9, "token_capacity": max_total_num_tokens // len(max_running_per_dp),
            "graph": 0.4}, "effective_max_running_requests_per_dp": n} for n in max_running_per_dp],
        "version": "0.5.4",
    }
