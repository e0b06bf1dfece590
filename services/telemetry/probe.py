"""Pure: turn what a member answered into a SlotHeartbeat."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proto import SlotHeartbeat

# Two consecutive failed probes mark a member down (one lost packet must not drop it).
FAILURES_BEFORE_DOWN = 2


@dataclass(frozen=True)
class Member:
    member_id: str
    url: str


def model_ids(models_body: Any) -> list[str]:
    """Model ids from an OpenAI ``GET /v1/models`` body; [] for anything else."""
    if not isinstance(models_body, dict) or not isinstance(models_body.get("data"), list):
        return []
    return [m["id"] for m in models_body["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)]


def stock_heartbeat(member: Member, *, session_id: str, seq: int, ts_s: float, models: list[str],
                    consecutive_failures: int, interval_s: float) -> SlotHeartbeat:
    state = "down" if consecutive_failures >= FAILURES_BEFORE_DOWN else "ready"
    return SlotHeartbeat(
        worker_id=member.member_id, session_id=session_id, seq=seq, ts_s=ts_s,
        model_id=models[0] if models else "", engine_kind="stock", backend=member.url, state=state,
        heartbeat_interval_s=interval_s,
    )
