"""Pure: a member's health across scrapes, and a scrape's Reading → the SlotHeartbeat on the bus."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from proto import EnergyReading, EnergySample, SlotHeartbeat
from services.telemetry.normalize import WH_TO_MJ, Reading

# Two consecutive failed scrapes mark a member down (one lost packet or slow answer must not drop it).
FAILURES_BEFORE_DOWN = 2

Transition = Literal["down", "recovered"]


@dataclass(frozen=True)
class Member:
    """An HTTP engine to watch. ``lanes``: the operator's declared lane count (max_num_seqs) for engines that
    do not export it (``--lanes``, else the pools file's ``max_seqs`` / ``metrics.backend_max_seqs``; lanes.py);
    ``api_key``: the pools file's key for the member, sent as ``Authorization: Bearer`` on every scrape."""

    member_id: str
    url: str
    lanes: int | None = None
    api_key: str | None = field(default=None, repr=False)  # a secret: kept out of reprs and logs


@dataclass
class Health:
    """Consecutive scrape failures; ``observe`` says when the member crosses into or out of "down"."""

    consecutive_failures: int = 0

    @property
    def is_down(self) -> bool:
        return self.consecutive_failures >= FAILURES_BEFORE_DOWN

    def observe(self, ok: bool) -> Transition | None:
        was_down = self.is_down
        self.consecutive_failures = 0 if ok else self.consecutive_failures + 1
        if was_down and ok:
            return "recovered"
        if not was_down and self.is_down:
            return "down"
        return None


def heartbeat(member: Member, reading: Reading, *, session_id: str, seq: int, ts_s: float,
              interval_s: float) -> SlotHeartbeat:
    """A ready member's heartbeat: every field the reading filled, None for the rest."""
    return SlotHeartbeat(
        worker_id=member.member_id, session_id=session_id, seq=seq, ts_s=ts_s, model_id=reading.model_id,
        engine_kind=reading.engine_kind, backend=member.url, state="ready", lanes=reading.lanes,
        running=reading.running, waiting=reading.waiting, max_context=reading.max_context, kv_usage=reading.kv_usage,
        kv_blocks_used=reading.kv_blocks_used, kv_blocks_total=reading.kv_blocks_total,
        kv_spills_total=reading.kv_spills_total, kv_evictions_total=reading.kv_evictions_total,
        preemptions_total=reading.preemptions_total, admitted_total=reading.admitted_total,
        prompt_tokens_queried_total=reading.prompt_tokens_queried_total,
        prompt_tokens_hit_total=reading.prompt_tokens_hit_total, prefill_tok_per_s=reading.prefill_tok_per_s,
        decode_tok_per_s=reading.decode_tok_per_s, energy_today_wh=reading.energy_today_wh,
        energy_30d_wh=reading.energy_30d_wh, kv_capacity_tokens=reading.kv_capacity_tokens,
        heartbeat_interval_s=interval_s, signal_sources=dict(reading.signal_sources) or None,
    )


def down_heartbeat(member: Member, last: Reading | None, *, session_id: str, seq: int, ts_s: float,
                   interval_s: float) -> SlotHeartbeat:
    """A down member: state "down", its last known kind and model, and no load figures (none is current)."""
    return SlotHeartbeat(
        worker_id=member.member_id, session_id=session_id, seq=seq, ts_s=ts_s,
        model_id=last.model_id if last else "", engine_kind=last.engine_kind if last else "stock",
        backend=member.url, state="down", heartbeat_interval_s=interval_s,
    )


def energy_sample(member: Member, reading: Reading, *, session_id: str, seq: int, ts_s: float) -> EnergySample | None:
    """The engine's own daily Wh figures as one monotone counter (mJ), for the ENERGY stream.

    ``energy_mj = Σ energy.daily[*].wh * 3.6e6``: a cumulative counter like NVML's, so the accounting
    takes deltas and a lost sample loses nothing; when the sum shrinks (the engine pruned its oldest day
    or lost its state) the accounting sees a reset and flags that interval. None when the engine
    reported no figure: no energy is unavailable energy, never 0 J.
    """
    if reading.energy_wh_total is None:
        return None
    return EnergySample(
        worker_id=member.member_id, session_id=session_id, seq=seq, ts_s=ts_s, model_id=reading.model_id,
        readings=[EnergyReading(device_id=member.member_id, kind="engine", method="engine_reported",
                                energy_mj=round(reading.energy_wh_total * WH_TO_MJ))],
    )
