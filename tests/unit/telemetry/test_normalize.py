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
        energy_today_wh=23.5, energy_wh_total=100.0 + 23.5, energy_30d_wh=95.25)


def test_ninfer_without_usage_still_reads_its_slots_and_says_nothing_of_the_rest() -> None:
    r = n.ninfer_reading(samples.ninfer_slots(running=8, waiting=4), None)
    assert (r.lanes, r.running, r.waiting) == (8, 8, 4)
    assert r.energy_wh_total is None and r.admitted_total is None and r.kv_usage is None


def test_our_engine_s_slots_carry_the_kv_page_total_so_kv_usage_is_used_over_total() -> None:
    slots = {**samples.ninfer_slots(), "kv_pages": {"main_occupied": 30, "backend_occupied": 0, "total": 120}}
    r = n.ninfer_reading(slots, None)
    assert r.kv_blocks_total == 120 and r.kv_usage == 30 / 120


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
        prompt_tokens_queried_total=1000, prompt_tokens_hit_total=250)


def test_an_operator_declared_max_num_seqs_gives_vllm_its_lanes() -> None:
    r = n.vllm_reading(_metrics(samples.VLLM_METRICS), n.ModelsInfo(), lanes=256)
    assert r.lanes == 256


def test_older_vllm_names_gpu_cache_usage_and_gpu_prefix_cache_and_max_num_seqs_label_are_read() -> None:
    r = n.vllm_reading(_metrics(samples.VLLM_OLD_METRICS), n.ModelsInfo(("llama",)), lanes=999)
    assert (r.running, r.waiting, r.kv_usage) == (1, 0, 0.05)
    assert (r.prompt_tokens_queried_total, r.prompt_tokens_hit_total) == (40, 10)
    assert r.lanes == 128  # the engine's own figure wins over the operator's
    assert (r.kv_blocks_total, r.kv_blocks_used) == (1000, round(0.05 * 1000))


def test_vllm_running_is_summed_and_kv_usage_averaged_over_data_parallel_engines() -> None:
    text = ('vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_running{engine="1"} 3\n'
            'vllm:kv_cache_usage_perc{engine="0"} 0.2\nvllm:kv_cache_usage_perc{engine="1"} 0.4\n')
    r = n.vllm_reading(_metrics(text), n.ModelsInfo())
    assert r.running == 2 + 3 and r.kv_usage == pytest.approx((0.2 + 0.4) / 2) and r.waiting is None


def test_metrics_without_vllm_running_are_not_a_vllm_reading() -> None:
    with pytest.raises(n.MalformedBody):
        n.vllm_reading(_metrics("vllm:num_requests_waiting 1\n"), n.ModelsInfo())


@pytest.mark.parametrize("old", [False, True])
def test_llamacpp_slots_in_both_shapes_give_lanes_and_running(old: bool) -> None:
    slots = samples.llamacpp_slots([True, False, True, False], old=old)
    r = n.llamacpp_reading(slots, None, n.models_info(samples.LLAMACPP_MODELS))
    assert r == n.Reading(engine_kind="llamacpp", model_id="qwen2.5-7b-q4_k_m.gguf", lanes=4, running=2,
                          max_context=4096)


def test_llamacpp_metrics_add_queue_kv_tokens_and_throughput() -> None:
    slots = samples.llamacpp_slots([False, False])
    r = n.llamacpp_reading(slots, _metrics(samples.LLAMACPP_METRICS), n.ModelsInfo())
    assert (r.lanes, r.running) == (2, 0)  # the slots array wins over requests_processing
    assert (r.waiting, r.kv_usage, r.kv_blocks_used) == (2, 0.25, 1024)
    assert (r.prompt_tokens_queried_total, r.prefill_tok_per_s, r.decode_tok_per_s) == (900, 600.0, 42.5)


def test_llamacpp_with_metrics_but_no_slots_reads_running_from_requests_processing() -> None:
    r = n.llamacpp_reading(None, _metrics(samples.LLAMACPP_METRICS), n.ModelsInfo())
    assert (r.lanes, r.running, r.waiting) == (None, 1, 2)


def test_llamacpp_slots_that_are_not_an_array_are_rejected() -> None:
    with pytest.raises(n.MalformedBody):
        n.llamacpp_reading({"slots": []}, None, n.ModelsInfo())


def test_sglang_metrics_map_running_queue_token_usage_and_throughput() -> None:
    r = n.sglang_reading(_metrics(samples.SGLANG_METRICS), n.ModelsInfo())
    assert r == n.Reading(engine_kind="sglang", model_id="meta-llama/Llama-3.1-8B-Instruct", running=5, waiting=4,
                          kv_usage=0.15, kv_blocks_used=6000, kv_blocks_total=40000, kv_capacity_tokens=40000,
                          decode_tok_per_s=312.5)


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
