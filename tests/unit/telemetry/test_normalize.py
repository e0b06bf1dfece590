"""Per-kind normalisers: exact engine bodies in, SlotHeartbeat fields out (None where the engine is silent)."""

from __future__ import annotations

import pytest

from services.telemetry import normalize as n
from services.telemetry.promparse import parse
from tests.unit.telemetry import samples


def _metrics(text: str):  # type: ignore[no-untyped-def]
    return parse(text, n.wanted_family)


def test_ninfer_slots_and_usage_fill_lanes_queue_counters_throughput_and_energy() -> None:
    # rolling_30d differs from the daily sum here (the engine's window is its own): each field has one source
    usage = samples.ninfer_usage({"2026-01-01": 100.0, "2026-01-02": None, "2026-01-03": 23.5}, spills=3, evicted=1,
                                 rolling_30d_wh=95.25)
    r = n.ninfer_reading(samples.ninfer_slots(running=2, waiting=1), usage)
    assert r == n.Reading(
        engine_kind="ninfer", model_id="qwen3.8-27b", lanes=8, running=2, waiting=1, kv_blocks_used=123,
        kv_spills_total=3, kv_evictions_total=1, admitted_total=42, prompt_tokens_queried_total=5000,
        prompt_tokens_hit_total=1500, prefill_tok_per_s=800.5, decode_tok_per_s=55.25,
        energy_today_wh=23.5, energy_wh_total=100.0 + 23.5, energy_30d_wh=95.25,
        signal_sources={"lanes": "/slots", "running": "/slots", "waiting": "/slots"})  # kv_usage unknown here


def test_ninfer_without_usage_still_reads_its_slots_and_says_nothing_of_the_rest() -> None:
    r = n.ninfer_reading(samples.ninfer_slots(running=8, waiting=4), None)
    assert (r.lanes, r.running, r.waiting) == (8, 8, 4)
    assert r.energy_wh_total is None and r.admitted_total is None and r.kv_usage is None


def test_our_engine_s_slots_carry_the_kv_page_total_so_kv_usage_is_used_over_total() -> None:
    slots = {**samples.ninfer_slots(), "kv_pages": {"main_occupied": 30, "backend_occupied": 0, "total": 120}}
    r = n.ninfer_reading(slots, None)
    assert r.kv_blocks_total == 120 and r.kv_usage == 30 / 120
    assert r.signal_sources["kv_usage"] == "/slots"


def test_energy_is_none_when_no_day_was_measured_never_zero() -> None:
    usage = samples.ninfer_usage({"2026-01-01": None})
    assert n.daily_wh_total(usage) is None
    assert n.ninfer_reading(samples.ninfer_slots(), usage).energy_today_wh is None
    assert n.daily_wh_total(samples.ninfer_usage({"2026-01-01": 0.0})) == 0.0  # measured zero is zero


def test_the_rolling_30_day_energy_is_read_as_reported_and_is_none_when_unknown_never_zero() -> None:
    slots = samples.ninfer_slots()
    assert n.ninfer_reading(slots, samples.ninfer_usage({"2026-01-01": 4.0, "2026-01-02": 6.5})).energy_30d_wh == (
        4.0 + 6.5)
    assert n.ninfer_reading(slots, samples.ninfer_usage({"2026-01-01": 0.0})).energy_30d_wh == 0.0  # measured zero
    usage = samples.ninfer_usage({"2026-01-01": 4.0})
    unknown = [
        None,  # no /usage at all
        samples.ninfer_usage({"2026-01-01": None}),  # wh: null
        {**usage, "energy": {k: v for k, v in usage["energy"].items() if k != "rolling_30d"}},  # an older fork
        {**usage, "energy": {**usage["energy"], "rolling_30d": {"kwh": 0.004}}},  # no wh
        {**usage, "energy": {**usage["energy"], "rolling_30d": {"wh": "4.0"}}},
        {**usage, "energy": {**usage["energy"], "rolling_30d": {"wh": -1.0}}},
        {**usage, "energy": {**usage["energy"], "rolling_30d": {"wh": float("nan")}}},
        {**usage, "energy": {**usage["energy"], "rolling_30d": [4.0]}},
    ]
    assert [n.ninfer_reading(slots, u).energy_30d_wh for u in unknown] == [None] * len(unknown)


@pytest.mark.parametrize("body", [None, [], {"max_concurrency": 0}, {"max_concurrency": "8"}, {"model": "x"},
                                  {"max_concurrency": True}])
def test_a_body_that_is_not_ninfer_slots_is_rejected(body: object) -> None:
    assert not n.is_ninfer_slots(body)
    with pytest.raises(n.MalformedBody):
        n.ninfer_reading(body, None)


def test_wrong_types_in_ninfer_bodies_read_as_unknown() -> None:
    slots = {**samples.ninfer_slots(), "requests_processing": "two", "requests_waiting": -1}
    usage = {"requests": {"total": 1.5e3}, "throughput": {"decode_tok_per_s": float("nan")}, "energy": "n/a"}
    r = n.ninfer_reading(slots, usage)
    assert r.running is None and r.waiting is None and r.admitted_total == 1500
    assert r.decode_tok_per_s is None and r.energy_wh_total is None


def test_vllm_metrics_map_running_waiting_kv_usage_prefix_cache_and_blocks() -> None:
    models = n.models_info(samples.VLLM_MODELS)
    r = n.vllm_reading(_metrics(samples.VLLM_METRICS), models)
    assert r == n.Reading(
        engine_kind="vllm", model_id="Qwen/Qwen3-8B", lanes=None, running=3, waiting=2, max_context=32768,
        kv_usage=0.4, kv_blocks_used=round(0.4 * 2000), kv_blocks_total=2000, kv_capacity_tokens=2000 * 16,
        preemptions_total=7,
        prompt_tokens_queried_total=1000, prompt_tokens_hit_total=250,
        process_start_s=1.7e9, tokens_processed_total=5000 + 700,  # restart markers (lanes.py)
        signal_sources={"running": "/metrics", "waiting": "/metrics", "kv_usage": "/metrics",
                        "kv_capacity_tokens": "cache_config_info", "max_context": "/v1/models"})


def test_upstream_vllm_exports_no_max_num_seqs_so_its_lanes_are_left_to_the_lane_rules() -> None:
    text = samples.VLLM_METRICS
    assert "vllm:cache_config_info{" in text and "max_num_seqs" not in text  # as vLLM's CacheConfig
    r = n.vllm_reading(_metrics(text), n.ModelsInfo())
    assert r.lanes is None and "lanes" not in r.signal_sources


def test_older_vllm_names_gpu_cache_usage_and_gpu_prefix_cache_and_max_num_seqs_label_are_read() -> None:
    r = n.vllm_reading(_metrics(samples.VLLM_OLD_METRICS), n.ModelsInfo(("llama",)))
    assert (r.running, r.waiting, r.kv_usage) == (1, 0, 0.05)
    assert (r.prompt_tokens_queried_total, r.prompt_tokens_hit_total) == (40, 10)
    assert r.lanes == 128 and r.signal_sources["lanes"] == "cache_config_info"
    assert r.process_start_s is None and r.tokens_processed_total is None  # multiprocess mode: no process_*
    assert (r.kv_blocks_total, r.kv_blocks_used) == (1000, round(0.05 * 1000))


def test_vllm_running_is_summed_and_kv_usage_averaged_over_data_parallel_engines() -> None:
    text = ('vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_running{engine="1"} 3\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.2\nvllm:kv_cache_usage_perc{engine="1"} 0.4\n'
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n'
            'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"} 1.0\n')
    r = n.vllm_reading(_metrics(text), n.ModelsInfo())
    assert r.running == 2 + 3 and r.kv_usage == pytest.approx((0.2 + 0.4) / 2) and r.waiting is None
    assert r.kv_capacity_tokens == (1000 + 1000) * 16  # each engine has its own KV cache


def test_metrics_without_vllm_running_are_not_a_vllm_reading() -> None:
    with pytest.raises(n.MalformedBody):
        n.vllm_reading(_metrics("vllm:num_requests_waiting 1\n"), n.ModelsInfo())


@pytest.mark.parametrize("old", [False, True])
def test_llamacpp_slots_in_both_shapes_give_lanes_and_running(old: bool) -> None:
    slots = samples.llamacpp_slots([True, False, True, False], old=old)
    r = n.llamacpp_reading(slots, None, n.models_info(samples.LLAMACPP_MODELS))
    assert r == n.Reading(engine_kind="llamacpp", model_id="qwen2.5-7b-q4_k_m.gguf", lanes=4, running=2,
                          max_context=4096,
                          signal_sources={"lanes": "/slots", "running": "/slots", "max_context": "/slots"})


def test_llamacpp_metrics_add_queue_kv_tokens_and_throughput() -> None:
    slots = samples.llamacpp_slots([False, False])
    r = n.llamacpp_reading(slots, _metrics(samples.LLAMACPP_METRICS), n.ModelsInfo())
    assert (r.lanes, r.running) == (2, 0)  # the slots array wins over requests_processing
    assert (r.waiting, r.kv_usage, r.kv_blocks_used) == (2, 0.25, 1024)
    assert (r.prompt_tokens_queried_total, r.prefill_tok_per_s, r.decode_tok_per_s) == (900, 600.0, 42.5)


def test_llamacpp_with_metrics_but_no_slots_reads_running_from_requests_processing() -> None:
    r = n.llamacpp_reading(None, _metrics(samples.LLAMACPP_METRICS), n.ModelsInfo())
    assert (r.lanes, r.running, r.waiting) == (None, 1, 2)
    assert r.tokens_processed_total == 900 + 300  # prompt_tokens_total + tokens_predicted_total


def test_a_no_slots_llamacpp_takes_its_lanes_and_context_from_props_and_its_load_from_metrics() -> None:
    props = n.llamacpp_props(samples.llamacpp_props(total_slots=4, n_ctx=8192))
    assert props == n.EngineInfo(source="/props", lanes=4, max_context=8192,
                                 model_id="qwen2.5-7b-instruct-q4_k_m.gguf")  # the file name of model_path
    r = n.llamacpp_reading(None, _metrics(samples.LLAMACPP_METRICS), n.ModelsInfo(), props)
    assert (r.lanes, r.running, r.waiting, r.max_context) == (4, 1, 2, 8192)
    assert r.signal_sources == {"lanes": "/props", "running": "/metrics", "waiting": "/metrics",
                                "kv_usage": "/metrics", "max_context": "/props"}
    assert r.model_id == "qwen2.5-7b-instruct-q4_k_m.gguf"


def test_a_llamacpp_answering_only_props_has_lanes_and_no_running() -> None:
    props = n.llamacpp_props(samples.llamacpp_props(total_slots=2, alias="qwen-7b"))
    r = n.llamacpp_reading(None, None, n.models_info(samples.LLAMACPP_MODELS), props)
    assert (r.lanes, r.running, r.waiting) == (2, None, None)
    assert r.signal_sources == {"lanes": "/props", "max_context": "/props"}
    assert r.model_id == "qwen2.5-7b-q4_k_m.gguf" and props.model_id == "qwen-7b"  # /v1/models first, then alias


def test_the_slots_array_wins_over_props_for_lanes_and_context() -> None:
    props = n.llamacpp_props(samples.llamacpp_props(total_slots=8, n_ctx=1024))
    r = n.llamacpp_reading(samples.llamacpp_slots([True, False]), None, n.ModelsInfo(), props)
    assert (r.lanes, r.running, r.max_context) == (2, 1, 4096) and r.signal_sources["lanes"] == "/slots"


@pytest.mark.parametrize("body", [samples.LLAMACPP_SLOTS_OFF, {}, [], {"total_slots": 0,
                                  "default_generation_settings": {}}, {"total_slots": 4},
                                  samples.sglang_server_info()])
def test_what_is_not_llamacpp_props_is_not_read_as_props(body: object) -> None:
    assert not n.is_llamacpp_props(body)
    with pytest.raises(n.MalformedBody):
        n.llamacpp_props(body)


def test_llamacpp_slots_that_are_not_an_array_are_rejected() -> None:
    with pytest.raises(n.MalformedBody):
        n.llamacpp_reading({"slots": []}, None, n.ModelsInfo())


def test_sglang_metrics_map_running_queue_token_usage_and_throughput() -> None:
    r = n.sglang_reading(_metrics(samples.SGLANG_METRICS), n.ModelsInfo())
    assert r == n.Reading(engine_kind="sglang", model_id="meta-llama/Llama-3.1-8B-Instruct", running=5, waiting=4,
                          kv_usage=0.15, kv_blocks_used=6000, kv_blocks_total=40000, kv_capacity_tokens=40000,
                          decode_tok_per_s=312.5, tokens_processed_total=12345,
                          signal_sources={"running": "/metrics", "waiting": "/metrics", "kv_usage": "/metrics",
                                          "kv_capacity_tokens": "/metrics"})


def test_sglang_server_info_gives_lanes_per_data_parallel_rank_kv_capacity_and_context() -> None:
    info = n.sglang_server_info(samples.sglang_server_info(max_running_per_dp=(32, 16), context_length=8192),
                                "/server_info")
    assert info == n.EngineInfo(source="/server_info", lanes=32 + 16, max_context=8192, kv_capacity_tokens=40000,
                                model_id="meta-llama/Llama-3.1-8B-Instruct")
    metrics = samples.SGLANG_METRICS.replace("sglang:max_total_num_tokens{", "sglang:other{")  # a build without it
    r = n.sglang_reading(_metrics(metrics), n.ModelsInfo(), info)
    assert (r.lanes, r.kv_capacity_tokens, r.max_context) == (48, 40000, 8192)
    assert {k: r.signal_sources[k] for k in ("lanes", "kv_capacity_tokens", "max_context", "running")} == {
        "lanes": "/server_info", "kv_capacity_tokens": "/server_info", "max_context": "/server_info",
        "running": "/metrics"}


def test_sglang_server_info_without_internal_states_falls_back_to_the_operator_s_max_running_requests() -> None:
    body = {k: v for k, v in samples.sglang_server_info(operator_max_running=64).items() if k != "internal_states"}
    info = n.sglang_server_info(body, "/get_server_info")
    assert (info.lanes, info.source, info.max_context) == (64, "/get_server_info", None)  # context_length unset
    unset = {k: v for k, v in samples.sglang_server_info().items() if k != "internal_states"}
    assert n.sglang_server_info(unset, "/server_info").lanes is None
    with pytest.raises(n.MalformedBody):
        n.sglang_server_info(["not", "an", "object"], "/server_info")


def test_an_older_sglang_s_max_running_requests_metric_wins_over_its_server_info() -> None:
    metrics = samples.SGLANG_METRICS + ("# HELP sglang:max_running_requests Maximum running requests\n"
                                        "# TYPE sglang:max_running_requests gauge\n"
                                        'sglang:max_running_requests{model_name="m"} 16.0\n')
    info = n.sglang_server_info(samples.sglang_server_info(max_running_per_dp=(48,)), "/server_info")
    r = n.sglang_reading(_metrics(metrics), n.ModelsInfo(), info)
    assert (r.lanes, r.signal_sources["lanes"]) == (16, "/metrics")


def test_a_nan_kv_gauge_and_an_escaped_model_name_read_as_unknown_and_as_written() -> None:
    v = n.vllm_reading(_metrics(samples.vllm_metrics(model_name=samples.MESSY_MODEL_NAME, kv_usage="NaN")),
                       n.ModelsInfo())
    assert v.model_id == 'acme/"fast", {8B} \\ fp8'
    assert v.kv_usage is None and v.kv_blocks_used is None and v.kv_blocks_total == 2000  # NaN: unknown, not 0
    assert (v.running, v.waiting, v.preemptions_total) == (3, 2, 7)  # the other gauges are unaffected
    s = n.sglang_reading(_metrics(samples.sglang_metrics(model_name=samples.MESSY_MODEL_NAME, token_usage="NaN")),
                         n.ModelsInfo())
    assert s.model_id == samples.MESSY_MODEL_NAME and s.kv_usage is None and (s.running, s.waiting) == (5, 4)


def test_a_counter_typed_without_total_whose_samples_carry_total_is_read() -> None:
    """OpenMetrics-minded exporters write ``# TYPE x counter`` and ``x_total``/``x_created`` samples."""
    text = samples.VLLM_METRICS
    assert "# TYPE vllm:num_preemptions counter\n" in text and "vllm:num_preemptions_total{" in text
    assert n.vllm_reading(_metrics(text), n.ModelsInfo()).preemptions_total == 7


@pytest.mark.parametrize(("text", "kind"), [
    (samples.VLLM_METRICS, "vllm"), (samples.VLLM_OLD_METRICS, "vllm"), (samples.LLAMACPP_METRICS, "llamacpp"),
    (samples.SGLANG_METRICS, "sglang"), ("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1\n",
                                         None),
])
def test_the_metric_prefix_names_the_kind(text: str, kind: str | None) -> None:
    assert n.metrics_kind(_metrics(text)) == kind


def test_a_stock_server_has_no_load_signal_at_all() -> None:
    r = n.stock_reading(n.models_info({"data": [{"id": "m1"}, {"id": "m2"}]}))
    assert r == n.Reading(engine_kind="stock", model_id="m1")


def test_a_models_body_without_a_data_list_is_rejected() -> None:
    with pytest.raises(n.MalformedBody):
        n.models_info({"models": ["x"]})
