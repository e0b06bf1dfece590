"""The load score of one engine from its heartbeat (docs/routing.md §1). Pure.

Shared by the gateway's router and telemetry's fleet metrics, so both report the same number.
"""

from __future__ import annotations

from dataclasses import dataclass

from proto import SlotHeartbeat

# docs/routing.md §1: vLLM's own signals (running/max_num_seqs, KV usage, waiting) weighed as the
# existing gateway does for vLLM backends; max_num_seqs is the heartbeat's ``lanes``.
VLLM_RUNNING_WEIGHT = 0.6
VLLM_KV_WEIGHT = 0.3
VLLM_WAITING_WEIGHT = 0.1
VLLM_WAITING_CAP = 5

LANE_KINDS = frozenset({"native", "ninfer"})


@dataclass(frozen=True)
class RoutingWeights:
    """Gateway-level scoring knobs (pools file ``metrics``)."""

    ninfer_lane_weight: float = 0.75
    ninfer_queue_weight: float = 0.15
    ninfer_pressure_weight: float = 0.10
    kv_high_water: float = 0.9
    stale_after_s: float = 3.0


# Timer jitter and transit allowed on top of two missed heartbeats before a member counts as stale.
STALE_SLACK_S = 0.2


def stale_limit_s(hb: SlotHeartbeat | None, stale_after_s: float) -> float:
    """How old a member's newest heartbeat may be before the member is stale.

    The configured threshold, or sooner when the member advertises its heartbeat interval: two missed
    heartbeats (plus :data:`STALE_SLACK_S`) mean it stopped, whatever the threshold says.
    """
    interval = hb.heartbeat_interval_s if hb is not None else None
    if interval is None or interval <= 0:
        return stale_after_s
    return min(stale_after_s, 2.0 * interval + STALE_SLACK_S)


def _counter_rose(hb: SlotHeartbeat, previous: SlotHeartbeat | None) -> bool:
    if previous is None or previous.session_id != hb.session_id:
        return False
    pairs = (
        (hb.kv_spills_total, previous.kv_spills_total),
        (hb.kv_evictions_total, previous.kv_evictions_total),
        (hb.preemptions_total, previous.preemptions_total),
    )
    return any(now is not None and before is not None and now > before for now, before in pairs)


def _kv_pressure(hb: SlotHeartbeat, previous: SlotHeartbeat | None, w: RoutingWeights) -> float:
    if _counter_rose(hb, previous):
        return 1.0
    if hb.kv_usage is not None and hb.kv_usage >= w.kv_high_water:
        return hb.kv_usage
    return 0.0


def load_score(kind: str, hb: SlotHeartbeat, previous: SlotHeartbeat | None, booked: int,
               weights: RoutingWeights) -> float | None:
    """Load in [0, 1] from the heartbeat plus ``booked`` unseen requests; None = no lane signal.

    Booked requests fill free lanes first and wait beyond them (docs/routing.md §1).
    """
    if kind not in LANE_KINDS and kind != "vllm":
        return None
    if not hb.lanes or hb.running is None:
        return None
    lanes = hb.lanes
    running = hb.running + booked
    waiting = hb.waiting or 0
    if running > lanes:
        waiting += running - lanes
        running = lanes
    if kind == "vllm":
        return (VLLM_RUNNING_WEIGHT * running / lanes + VLLM_KV_WEIGHT * (hb.kv_usage or 0.0)
                + VLLM_WAITING_WEIGHT * min(waiting, VLLM_WAITING_CAP) / VLLM_WAITING_CAP)
    lane_p = 1.0 if waiting > 0 else min(running / lanes, 1.0)
    queue_p = min(waiting / max(lanes / 2, 1), 1.0)
    return (weights.ninfer_lane_weight * lane_p + weights.ninfer_queue_weight * queue_p
            + weights.ninfer_pressure_weight * _kv_pressure(hb, previous, weights))
