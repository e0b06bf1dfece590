"""The seam between the gateway's I/O shell and the pure router: builds the router's member states
from the fleet and pool config, asks it for a ranking, and keeps its affinity and pin tables."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proto import SlotHeartbeat
from services.common import openai_api
from services.gateway import router
from services.gateway.fleet import Fleet
from services.gateway.pools import MemberRef, ResolvedPool


@dataclass(frozen=True)
class Decision:
    reason: str
    ranked: tuple[str, ...]
    candidates: tuple[Any, ...]

    def explain(self) -> dict[str, Any]:
        return {"reason": self.reason, "ranked": list(self.ranked),
                "candidates": [c.__dict__ if hasattr(c, "__dict__") else c for c in self.candidates]}


class Router:
    def __init__(self, data_dir: Path | None) -> None:
        self.data_dir = data_dir

    def load_of(self, hb: SlotHeartbeat, previous: SlotHeartbeat | None) -> float:
        return router.load_score(hb, previous)

    def _states(self, resolved: ResolvedPool, fleet: Fleet, now_s: float) -> list[router.MemberState]:
        out = []
        for ref in resolved.members:
            rec = fleet.record(ref.member_id)
            if rec.heartbeat is None or rec.received_s is None or fleet.is_down(ref.member_id, now_s):
                continue
            out.append(router.MemberState(ref.member_id, rec.heartbeat, rec.previous, rec.received_s,
                                          rec.routed_total, fleet.admitted(ref.member_id), rec.in_flight))
        return out

    def decide(self, resolved: ResolvedPool, parsed: openai_api.ParsedRequest, session_key: str | None,
               fleet: Fleet, now_s: float, stale_after_s: float, rng: random.Random) -> Decision:
        states = self._states(resolved, fleet, now_s)
        pick = router.pick_member(states, now_s, stale_after_s)
        order = sorted(pick.candidates, key=lambda c: c.score)
        return Decision(pick.reason, tuple(c.worker_id for c in order), pick.candidates)

    def record_success(self, resolved: ResolvedPool, parsed: openai_api.ParsedRequest, session_key: str | None,
                       member_id: str, now_s: float) -> None:
        pass

    def describe_member(self, resolved: ResolvedPool, ref: MemberRef, fleet: Fleet, now_s: float,
                        stale_after_s: float) -> dict[str, Any]:
        rec = fleet.record(ref.member_id)
        hb = rec.heartbeat
        age = None if rec.received_s is None else now_s - rec.received_s
        queried = hb.prompt_tokens_queried_total if hb else None
        return {
            "pool": resolved.pool.name, "member_id": ref.member_id, "backend": ref.backend, "kind": ref.kind,
            "engine_kind": hb.engine_kind if hb else None, "state": hb.state if hb else "unknown",
            "lanes": hb.lanes if hb else None, "running": hb.running if hb else None,
            "waiting": hb.waiting if hb else None, "kv_usage": hb.kv_usage if hb else None,
            "load_score": self.load_of(hb, rec.previous) if hb else None,
            "no_signal": hb is None or not hb.lanes,
            "load_history": list(rec.load_history), "heartbeat_age_s": age,
            "stale": age is None or age > stale_after_s, "in_flight": rec.in_flight,
            "energy_today_wh": hb.energy_today_wh if hb else None,
            "cache_hit_pct": (100.0 * (hb.prompt_tokens_hit_total or 0) / queried) if hb and queried else None,
            "capacity_weight": ref.capacity_weight, "down": fleet.is_down(ref.member_id, now_s),
        }

    def save(self) -> None:
        pass
