"""Routing as pure functions over plain data: no I/O, no clock, no randomness of its own.

Load score (docs/architecture.md "Routing"), for the native/NInfer engine kind::

    laneP  = 1 if waiting > 0 else min(running / lanes, 1)
    queueP = min(waiting / max(lanes / 2, 1), 1)
    kvP    = 1 if spills or evictions rose since the previous heartbeat else (kv_usage if above the
             high-water mark, else 0)
    score  = 0.75·laneP + 0.15·queueP + 0.10·kvP

In-flight booking: the gateway counts what it has routed to a worker in this worker session
(``routed_total``); the heartbeat says how many of this gateway's requests the engine has admitted
(``admitted_by_gateway[gateway_id]``). Only the difference (routed but not yet seen by the engine)
is added to ``running`` before scoring,
so nothing is counted twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proto import SlotHeartbeat

LANE_WEIGHT = 0.75
QUEUE_WEIGHT = 0.15
KV_WEIGHT = 0.10
KV_HIGH_WATER = 0.90


@dataclass(frozen=True)
class MemberState:
    """What the gateway knows about one worker at decision time."""

    worker_id: str
    heartbeat: SlotHeartbeat
    previous: SlotHeartbeat | None
    received_s: float
    routed_total: int  # requests this gateway sent to the worker's current session
    admitted: int | None  # of those, how many the heartbeat says the engine has admitted
    in_flight: int  # requests of this gateway currently open on the worker


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    score: float
    booked: int
    age_s: float


@dataclass(frozen=True)
class Pick:
    worker_id: str | None
    reason: str
    candidates: tuple[Candidate, ...]


def unseen_bookings(member: MemberState) -> int:
    """Requests routed to the worker that its last heartbeat cannot reflect yet."""
    if member.admitted is None:  # the engine does not say: every open request may be unseen
        return member.in_flight
    return max(0, min(member.in_flight, member.routed_total - member.admitted))


def kv_pressure(hb: SlotHeartbeat, previous: SlotHeartbeat | None) -> float:
    if previous is not None and previous.session_id == hb.session_id:
        for now_v, before_v in (
            (hb.kv_spills_total, previous.kv_spills_total),
            (hb.kv_evictions_total, previous.kv_evictions_total),
            (hb.preemptions_total, previous.preemptions_total),
        ):
            if now_v is not None and before_v is not None and now_v > before_v:
                return 1.0
    if hb.kv_usage is not None and hb.kv_usage >= KV_HIGH_WATER:
        return hb.kv_usage
    return 0.0


def load_score(hb: SlotHeartbeat, previous: SlotHeartbeat | None = None, booked: int = 0) -> float:
    """Load in [0, 1]; 0.0 for engines that publish no lane signal ("no signal")."""
    if not hb.lanes or hb.running is None:
        return 0.0
    lanes = hb.lanes
    running = hb.running + booked
    waiting = hb.waiting or 0
    if running > lanes:  # booked requests beyond the lanes will wait
        waiting += running - lanes
        running = lanes
    lane_p = 1.0 if waiting > 0 else min(running / lanes, 1.0)
    queue_p = min(waiting / max(lanes / 2, 1), 1.0)
    return LANE_WEIGHT * lane_p + QUEUE_WEIGHT * queue_p + KV_WEIGHT * kv_pressure(hb, previous)


def is_live(member: MemberState, now_s: float, stale_after_s: float) -> bool:
    return member.heartbeat.state == "ready" and now_s - member.received_s <= stale_after_s


def pick_member(members: Sequence[MemberState], now_s: float, stale_after_s: float) -> Pick:
    """The least-loaded live member; ties go to more lanes, then to the lower worker id (stable)."""
    candidates = []
    for m in members:
        if not is_live(m, now_s, stale_after_s):
            continue
        booked = unseen_bookings(m)
        candidates.append(
            Candidate(m.worker_id, load_score(m.heartbeat, m.previous, booked), booked, now_s - m.received_s)
        )
    if not candidates:
        return Pick(None, "no_live_member", ())
    lanes = {m.worker_id: m.heartbeat.lanes or 0 for m in members}
    best = min(candidates, key=lambda c: (c.score, -lanes[c.worker_id], c.worker_id))
    reason = "only_member" if len(candidates) == 1 else "least_loaded"
    return Pick(best.worker_id, reason, tuple(candidates))
