"""Telemetry's own /metrics: one block per family, whatever the number of members (issue #24)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from proto import SlotHeartbeat
from services.common.prom import Histogram, PromText
from services.telemetry.views import MemberStatus, metrics_text


def _member(mid: str, kind: str, running: int) -> MemberStatus:
    hb = SlotHeartbeat(worker_id=mid, session_id="s", seq=1, ts_s=0.0, model_id="m", engine_kind=kind,
                       lanes=4, running=running, waiting=0, kv_usage=0.5)
    return MemberStatus(member_id=mid, url=f"http://{mid}", engine_kind=kind, is_up=True, heartbeat=hb,
                        previous=None, last_ok_s=99.0, scrapes_total=10, failures_total=1)


def test_three_members_give_each_family_once_typed_with_all_its_samples_together() -> None:
    text = metrics_text([_member("a", "vllm", 1), _member("b", "llamacpp", 4), _member("c", "ninfer", 0)], 100.0)
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names))  # no family split into an untyped second block
    assert all(f.type in ("gauge", "counter") for f in families), {f.name: f.type for f in families}
    running = next(f for f in families if f.name == "llmgw_telemetry_member_running")
    assert sorted(s.labels["member"] for s in running.samples) == ["a", "b", "c"]
    scrapes = next(f for f in families if f.name == "llmgw_telemetry_scrapes")
    assert [s.value for s in scrapes.samples] == [10, 10, 10]
    # in the text, a family's samples follow its TYPE line without another family between them
    lines = [ln for ln in text.splitlines() if ln.startswith("llmgw_telemetry_member_running")]
    first = text.splitlines().index(lines[0])
    assert text.splitlines()[first:first + 3] == lines


def test_histograms_and_labels_added_out_of_order_render_grouped() -> None:
    m = PromText()
    hist = Histogram((0.1, 1.0))
    hist.observe(0.5)
    m.gauge("g", "a gauge", 1, {"x": "1"})
    m.histogram("h", "a histogram", hist, {"x": "1"})
    m.gauge("g", "a gauge", 2, {"x": "2"})
    m.histogram("h", "a histogram", hist, {"x": "2"})
    families = {f.name: f for f in text_string_to_metric_families(m.render())}
    assert families["g"].type == "gauge" and len(families["g"].samples) == 2
    assert families["h"].type == "histogram" and {s.labels["x"] for s in families["h"].samples} == {"1", "2"}


def test_telemetry_s_metrics_and_members_say_where_each_figure_came_from_and_count_retries() -> None:
    from services.telemetry.views import members_body

    hb = SlotHeartbeat(worker_id="v", session_id="s", seq=1, ts_s=0.0, model_id="m", engine_kind="vllm", lanes=3,
                       running=1, waiting=0, kv_usage=0.2,
                       signal_sources={"lanes": "default", "running": "/metrics", "waiting": "/metrics"})
    row = MemberStatus(member_id="v", url="http://v", engine_kind="vllm", is_up=True, heartbeat=hb, previous=None,
                       last_ok_s=99.0, scrapes_total=4, failures_total=0, retries_total=2)
    values = {(s.name, s.labels.get("field"), s.labels.get("source")): s.value
              for f in text_string_to_metric_families(metrics_text([row], 100.0)) for s in f.samples
              if s.labels.get("member") == "v"}
    assert values[("llmgw_telemetry_member_signal_source", "lanes", "default")] == 1
    assert values[("llmgw_telemetry_member_signal_source", "running", "/metrics")] == 1
    assert values[("llmgw_telemetry_request_retries_total", None, None)] == 2
    (member,) = members_body([row], 100.0)["members"]
    assert (member["lanes"], member["signal_sources"]["lanes"], member["retries_total"]) == (3, "default", 2)
