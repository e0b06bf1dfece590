"""The gateway's view of the workers: newest heartbeat per worker and its own bookings."""

from __future__ import annotations

from dataclasses import dataclass, field

from proto import SlotHeartbeat
from services.gateway.router import MemberState

# Heartbeats whose backend is this (or empty) come from bus workers the gateway can route to.
# HTTP members (backend = their URL) are proxied once the gateway grows HTTP pools (issue #5).
BUS_BACKEND = "nats"


def _routable(hb: SlotHeartbeat) -> bool:
    return hb.backend in ("", BUS_BACKEND)


@dataclass
class _Worker:
    heartbeat: SlotHeartbeat
    previous: SlotHeartbeat | None
    received_s: float
    routed_total: int = 0
    in_flight: int = 0


@dataclass
class Fleet:
    gateway_id: str
    workers: dict[str, _Worker] = field(default_factory=dict)

    def observe(self, hb: SlotHeartbeat, now_s: float) -> bool:
        """Record a heartbeat; returns False for one older than what we hold (out of order)."""
        current = self.workers.get(hb.worker_id)
        if current is None:
            self.workers[hb.worker_id] = _Worker(hb, None, now_s)
            return True
        if current.heartbeat.session_id == hb.session_id:
            if hb.seq <= current.heartbeat.seq:
                return False
            current.previous = current.heartbeat
        else:  # the worker restarted: its counters began again, and so do our bookings
            current.previous = None
            current.routed_total = 0
        current.heartbeat = hb
        current.received_s = now_s
        return True

    def models(self) -> list[str]:
        return sorted({w.heartbeat.model_id for w in self.workers.values() if _routable(w.heartbeat)})

    def members_for(self, model: str) -> list[MemberState]:
        return [
            MemberState(
                wid, w.heartbeat, w.previous, w.received_s, w.routed_total,
                w.heartbeat.admitted_by_gateway.get(self.gateway_id), w.in_flight,
            )
            for wid, w in self.workers.items()
            if w.heartbeat.model_id == model and _routable(w.heartbeat)
        ]

    def max_context(self, model: str) -> int | None:
        values = [w.heartbeat.max_context for w in self.workers.values() if w.heartbeat.model_id == model]
        known = [v for v in values if v]
        return max(known) if known else None

    def book(self, worker_id: str) -> None:
        w = self.workers.get(worker_id)
        if w is not None:
            w.routed_total += 1
            w.in_flight += 1

    def release(self, worker_id: str) -> None:
        w = self.workers.get(worker_id)
        if w is not None and w.in_flight > 0:
            w.in_flight -= 1
