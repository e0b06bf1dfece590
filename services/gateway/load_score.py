"""The router's load score of one member and when its heartbeat is stale (docs/routing.md §1). Pure.

The formula is :func:`services.common.heartbeat_load.heartbeat_load`, shared with telemetry's fleet
metrics so both report the same number; here it is weighed with the pools file's ``metrics`` knobs and
this gateway's bookings.
"""

from __future__ import annotations

from dataclasses import dataclass

from proto import SlotHeartbeat
from services.common import heartbeat_load as hl


@dataclass(frozen=True)
class RoutingWeights:
    """Gateway-level scoring knobs (pools file ``metrics``)."""

    ninfer_lane_weight: float = hl.NINFER_LANE_WEIGHT
    ninfer_queue_weight: float = hl.NINFER_QUEUE_WEIGHT
    ninfer_pressure_weight: float = hl.NINFER_PRESSURE_WEIGHT
    kv_high_water: float = hl.KV_HIGH_WATER
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


def load_score(kind: str, hb: SlotHeartbeat, previous: SlotHeartbeat | None, booked: int,
               weights: RoutingWeights) -> float | None:
    """Load in [0, 1] from the heartbeat plus ``booked`` unseen requests; None = no lane signal.

    Booked requests fill free lanes first and wait beyond them (docs/routing.md §1).
    """
    return hl.heartbeat_load(kind, hb, previous, booked, lane_weight=weights.ninfer_lane_weight,
                             queue_weight=weights.ninfer_queue_weight,
                             pressure_weight=weights.ninfer_pressure_weight, kv_high_water=weights.kv_high_water)
