"""The load one engine's heartbeat reports, in [0, 1] (docs/routing.md §1). Pure; imports only proto.

The one formula both the gateway's router (:mod:`services.gateway.load_score`, with the pools file's
weights and its own bookings) and telemetry's fleet metrics (the default weights, no bookings) use, so
both report the same number. Its defaults are the only ones: the gateway's ``RoutingWeights`` takes them
from here.
"""

from __future__ import annotations

from proto import SlotHeartbeat

# docs/routing.md §1: vLLM's own signals (running/max_num_seqs, KV usage, waiting) weighed as the
# existing gateway does for vLLM backends; max_num_seqs is the heartbeat's ``lanes``.
VLLM_RUNNING_WEIGHT = 0.6
VLLM_KV_WEIGHT = 0.3
VLLM_WAITING_WEIGHT = 0.1
VLLM_WAITING_CAP = 5

# Kinds whose heartbeat counts lanes the lane formula reads: our engines (lanes), llama.cpp (``/slots``: one
# entry per slot, ``is_processing``, else ``/props`` ``total_slots``; ``llamacpp:requests_deferred`` waiting) and
# SGLang (``sglang:max_running_requests`` or ``/server_info``, ``num_running_reqs``, ``num_queue_reqs``). Issue #24:
# llama.cpp's signal was collected and shown, then ignored, so a member with every slot busy took requests over an
# idle one. vLLM has its own branch below. Telemetry fills ``lanes`` for vllm, llamacpp and sglang even when the
# engine does not say (declared, learned or the default: services/telemetry/lanes.py), so every member that
# reports running gets a number; only one with no running at all (stock) is None.
LANE_KINDS = frozenset({"native", "ninfer", "llamacpp", "sglang"})

# Our engines' weights (pools file ``metrics``: the gateway may set others) and the KV occupancy that counts
# as pressure.
NINFER_LANE_WEIGHT = 0.75
NINFER_QUEUE_WEIGHT = 0.15
NINFER_PRESSURE_WEIGHT = 0.10
KV_HIGH_WATER = 0.9


# Kinds whose ``kv_evictions_total`` counts KV taken from live work (the NInfer fork, kind "ninfer":
# ``health.sessions_evicted``, a session's cache dropped to make room), which is pressure. Our engine (kind
# "native", services/engine/serve/worker.py: the block pool's ``num_evictions``) counts LRU evictions of *unused*
# cached prefix blocks, which a full prefix cache does on every new prefill: that says nothing about load (issue
# #29: counted, a member turned "busy" and lost its affinity credit whenever an eviction fell in the last
# heartbeat interval, 18 % of observations at 0.25 s heartbeats). The set first named "native" (the kinds the
# wrong way round), so our own engine's evictions still counted; bench/routing_sim.py now reports as "native".
EVICTIONS_ARE_PRESSURE = frozenset({"ninfer"})


def _counter_rose(kind: str, hb: SlotHeartbeat, previous: SlotHeartbeat | None) -> bool:
    """Spills, preemptions (and, for :data:`EVICTIONS_ARE_PRESSURE` kinds, evictions) since the previous
    heartbeat of the same session: the engine ran out of KV for running work."""
    if previous is None or previous.session_id != hb.session_id:
        return False
    pairs = [
        (hb.kv_spills_total, previous.kv_spills_total),
        (hb.preemptions_total, previous.preemptions_total),
    ]
    if kind in EVICTIONS_ARE_PRESSURE:
        pairs.append((hb.kv_evictions_total, previous.kv_evictions_total))
    return any(now is not None and before is not None and now > before for now, before in pairs)


def _kv_pressure(kind: str, hb: SlotHeartbeat, previous: SlotHeartbeat | None, kv_high_water: float) -> float:
    if _counter_rose(kind, hb, previous):
        return 1.0
    if hb.kv_usage is not None and hb.kv_usage >= kv_high_water:
        return hb.kv_usage
    return 0.0


def heartbeat_load(kind: str, hb: SlotHeartbeat, previous: SlotHeartbeat | None, booked: int = 0, *,
                   lane_weight: float = NINFER_LANE_WEIGHT, queue_weight: float = NINFER_QUEUE_WEIGHT,
                   pressure_weight: float = NINFER_PRESSURE_WEIGHT, kv_high_water: float = KV_HIGH_WATER
                   ) -> float | None:
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
    kv_p = _kv_pressure(kind, hb, previous, kv_high_water)
    return lane_weight * lane_p + queue_weight * queue_p + pressure_weight * kv_p
