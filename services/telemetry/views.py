"""Pure: telemetry's own ``/metrics`` and ``/members`` bodies from each member's status; the clock is passed in.

The load score is the shared pure ``heartbeat_load`` (the formula the gateway's router weighs) with
default weights and no bookings, so a dashboard reading telemetry shows the number the router would
compute from the same heartbeat (None for no-signal kinds: then the gauge is absent, never 0).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from proto import SlotHeartbeat
from services.common.heartbeat_load import heartbeat_load
from services.common.prom import PromText


@dataclass(frozen=True)
class MemberStatus:
    member_id: str
    url: str
    engine_kind: str | None  # None: not detected yet
    is_up: bool
    heartbeat: SlotHeartbeat | None  # the newest published one (ready or down)
    previous: SlotHeartbeat | None
    last_ok_s: float | None  # wall-clock time of the newest successful scrape
    scrapes_total: int
    failures_total: int
    is_discovered: bool = False
    retries_total: int = 0  # requests asked a second time within a scrape (timeout, connection error, 5xx)

    def load(self) -> float | None:
        hb = self.heartbeat
        if hb is None or hb.state != "ready":
            return None
        return heartbeat_load(hb.engine_kind, hb, self.previous)


def metrics_text(members: Iterable[MemberStatus], now_s: float) -> str:
    m = PromText()
    rows = list(members)
    m.gauge("llmgw_telemetry_members", "HTTP members watched.", len(rows))
    for row in rows:
        labels = {"member": row.member_id, "kind": row.engine_kind or "unknown"}
        hb = row.heartbeat if row.heartbeat is not None and row.heartbeat.state == "ready" else None
        m.gauge("llmgw_telemetry_member_up", "1 while the member answers its scrapes (2 failures: 0).",
                1 if row.is_up else 0, labels)
        m.gauge("llmgw_telemetry_member_load_score", "The router's load score from the newest heartbeat (absent: "
                "no signal).", row.load(), labels)
        m.gauge("llmgw_telemetry_member_lanes", "Lanes (max concurrent requests).", hb.lanes if hb else None, labels)
        m.gauge("llmgw_telemetry_member_running", "Requests running.", hb.running if hb else None, labels)
        m.gauge("llmgw_telemetry_member_waiting", "Requests waiting.", hb.waiting if hb else None, labels)
        m.gauge("llmgw_telemetry_member_kv_usage", "KV-cache occupancy, 0..1.", hb.kv_usage if hb else None, labels)
        m.gauge("llmgw_telemetry_member_heartbeat_age_seconds", "Seconds since the newest successful scrape.",
                None if row.last_ok_s is None else max(0.0, now_s - row.last_ok_s), labels)
        m.counter("llmgw_telemetry_scrapes_total", "Scrapes attempted.", row.scrapes_total, {"member": row.member_id})
        m.counter("llmgw_telemetry_scrape_failures_total", "Scrapes that failed (error, bad body, timeout).",
                  row.failures_total, {"member": row.member_id})
        m.counter("llmgw_telemetry_request_retries_total", "Requests asked a second time within a scrape "
                  "(timeout, connection error, 5xx).", row.retries_total, {"member": row.member_id})
        for name, source in sorted((hb.signal_sources or {}).items() if hb else ()):
            m.gauge("llmgw_telemetry_member_signal_source", "1 for where each heartbeat field came from "
                    "(field, source; docs/telemetry.md).", 1, {**labels, "field": name, "source": source})
    return m.render()


def members_body(members: Iterable[MemberStatus], now_s: float) -> dict[str, Any]:
    """``GET /members``: what telemetry watches, discovered members included (to offer to a pools file)."""
    out = []
    for row in members:
        hb = row.heartbeat
        out.append({
            "member_id": row.member_id, "backend": row.url, "engine_kind": row.engine_kind, "up": row.is_up,
            "discovered": row.is_discovered, "model_id": hb.model_id if hb else None,
            "load_score": row.load(), "heartbeat_age_s": None if row.last_ok_s is None else now_s - row.last_ok_s,
            "lanes": hb.lanes if hb else None, "running": hb.running if hb else None,
            "waiting": hb.waiting if hb else None, "signal_sources": hb.signal_sources if hb else None,
            "scrapes_total": row.scrapes_total, "failures_total": row.failures_total,
            "retries_total": row.retries_total,
        })
    return {"members": out}
