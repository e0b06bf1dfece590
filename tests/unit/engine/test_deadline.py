"""The engine side of GenerateRequest.deadline_s: its error fields, its counter and its /metrics line."""

from __future__ import annotations

import pickle

from services.engine.core.scheduler import SchedulerStats
from services.engine.errors import DeadlineExceededError
from services.engine.outputs import EngineSnapshot
from services.engine.serve.async_engine import EngineHandle
from services.engine.serve.frontend import error_info
from services.engine.serve.views import RequestStats, metrics_text


def snapshot() -> EngineSnapshot:
    stats = SchedulerStats(num_running=0, num_waiting=0, num_prefilling=0, num_decoding=0, num_kv_blocks_used=0,
                           num_kv_blocks_total=8, kv_usage=0.0, num_preemptions_total=0, num_evictions_total=0,
                           num_prompt_tokens_queried=0, num_prompt_tokens_hit=0)
    return EngineSnapshot(stats=stats, lanes=1, max_pending=4, max_context=64, kv_capacity_tokens=112,
                          admitted_total=0, admitted_by_source={}, prompt_tokens_total=0, output_tokens_total=0,
                          prefill_tok_per_s=0.0, decode_tok_per_s=0.0)


def test_a_missed_deadline_is_a_504_deadline_exceeded() -> None:
    exc = DeadlineExceededError(deadline_s=100.0, now_s=100.25, where="while queued")
    info = error_info(exc)
    assert (info.status, info.code, info.type) == (504, "deadline_exceeded", "timeout_error")
    assert info.message == "deadline exceeded 0.250 s ago, while queued" and info.retry_after_s is None
    again = pickle.loads(pickle.dumps(exc))  # crosses a process boundary with its fields
    assert (again.deadline_s, again.now_s, again.where, again.message) == (100.0, 100.25, "while queued", exc.message)


def test_deadline_drops_are_counted_on_the_handle_and_in_metrics() -> None:
    handle = EngineHandle(clock=lambda: 0.0)
    assert handle.num_deadline_dropped == 0
    handle.count_deadline_dropped()
    handle.count_deadline_dropped()
    text = metrics_text("m", snapshot(), RequestStats(), 1.0, None, 16, handle.num_deadline_dropped)
    assert "# TYPE ninfer:requests_deadline_dropped_total counter" in text
    assert "\nninfer:requests_deadline_dropped_total 2\n" in text
    assert "\nninfer:requests_deadline_dropped_total 0\n" in metrics_text("m", snapshot(), RequestStats(), 1.0,
                                                                          None, 16)
