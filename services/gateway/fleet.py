"""The gateway's view of every member: newest heartbeat (bus workers and telemetry-published HTTP
members alike), its own bookings, recent failures, and a short load history for /backends sparklines.

:class:`HeartbeatIntake` feeds it: the ``llm_workers`` KV bucket at start, then every heartbeat on the bus.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg

from proto import ProtoDecodeError, SlotHeartbeat, decode, subjects
from services.gateway.breaker import BASE_COOLDOWN_S, Breaker, FailureKind

log = logging.getLogger(__name__)

BUS_BACKEND = "nats"
DOWN_AFTER_FAILURE_S = BASE_COOLDOWN_S  # a member that failed a request is skipped at least this long
HISTORY_POINTS = 60
CPT_MIN_TOKENS = 32  # prompts at least this long teach the gateway a member's characters per token
CPT_ALPHA = 0.1  # the weight of each new prompt in the running average
CPT_BOUNDS = (1.0, 12.0)  # clamp: a garbled count cannot make a cache look empty or infinite


@dataclass
class MemberRecord:
    heartbeat: SlotHeartbeat | None = None
    previous: SlotHeartbeat | None = None
    received_s: float | None = None
    routed_total: int = 0
    in_flight: int = 0
    pending_prefill_chars: int = 0
    breaker: Breaker = field(default_factory=Breaker)  # fed by request outcomes (breaker.py)
    load_history: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=HISTORY_POINTS))
    # prompt characters per token, measured from the member's own answers (an average over recent prompts)
    chars_per_token: float | None = None


@dataclass
class Fleet:
    gateway_id: str
    members: dict[str, MemberRecord] = field(default_factory=dict)

    def observe(self, hb: SlotHeartbeat, now_s: float) -> bool:
        """Record a heartbeat; returns False for one older than what we hold (out of order)."""
        rec = self.record(hb.worker_id)
        current = rec.heartbeat
        if current is not None and current.session_id == hb.session_id:
            if hb.seq <= current.seq:
                return False
            rec.previous = current
        else:  # first sight, or the engine restarted: its counters began again, and so do our bookings
            rec.previous = None
            rec.routed_total = 0
            if current is not None:
                rec.breaker.reset()  # a failure seen before belonged to the previous process
        if (rec.breaker.consecutive_failures and hb.backend in ("", BUS_BACKEND)
                and now_s - rec.breaker.opened_at_s >= (hb.heartbeat_interval_s or DOWN_AFTER_FAILURE_S)):
            # A bus worker heartbeats on the connection it serves on: one heard a full interval after the
            # failure is subscribed again (e.g. it rejoined after a NATS restart), so it need not sit out.
            rec.breaker.reset()
        rec.heartbeat = hb
        rec.received_s = now_s
        return True

    def record(self, member_id: str) -> MemberRecord:
        rec = self.members.get(member_id)  # not setdefault: it would build a record (and a deque) every call
        if rec is None:
            rec = self.members[member_id] = MemberRecord()
        return rec

    def bus_workers(self, model_id: str | None = None) -> list[str]:
        """Bus workers (any model, or serving ``model_id``), in id order."""
        return sorted(
            wid for wid, rec in self.members.items()
            if rec.heartbeat is not None and rec.heartbeat.backend in ("", BUS_BACKEND)
            and (model_id is None or rec.heartbeat.model_id == model_id)
        )

    def admitted(self, member_id: str) -> int | None:
        """How many of our requests the member's heartbeat says it received; None when it cannot say."""
        hb = self.record(member_id).heartbeat
        if hb is None or hb.engine_kind != "native":  # only our engine counts per gateway
            return None
        return hb.admitted_by_gateway.get(self.gateway_id, 0)

    def book(self, member_id: str) -> None:
        rec = self.record(member_id)
        rec.routed_total += 1
        rec.in_flight += 1

    def unbook(self, member_id: str) -> None:
        """The member refused before admitting (429, connect error): it will never count this one."""
        rec = self.record(member_id)
        rec.routed_total = max(0, rec.routed_total - 1)

    def note_prompt(self, member_id: str, prompt_chars: int, prompt_tokens: int | None) -> None:
        """The member counted ``prompt_tokens`` for a prompt of ``prompt_chars`` characters (as the gateway
        measures prompts: message contents): update its characters per token (docs/routing.md §3). Prompts
        shorter than :data:`CPT_MIN_TOKENS` are skipped (the chat template's own tokens dominate them)."""
        if prompt_tokens is None or prompt_tokens < CPT_MIN_TOKENS or prompt_chars <= 0:
            return
        ratio = min(max(prompt_chars / prompt_tokens, CPT_BOUNDS[0]), CPT_BOUNDS[1])
        rec = self.record(member_id)
        rec.chars_per_token = ratio if rec.chars_per_token is None else (
            (1 - CPT_ALPHA) * rec.chars_per_token + CPT_ALPHA * ratio)

    def add_pending_prefill(self, member_id: str, chars: int) -> None:
        rec = self.record(member_id)
        rec.pending_prefill_chars = max(0, rec.pending_prefill_chars + chars)

    def release(self, member_id: str) -> None:
        rec = self.record(member_id)
        if rec.in_flight > 0:
            rec.in_flight -= 1

    def attempt(self, member_id: str, now_s: float) -> None:
        """A request goes to the member (a half-open breaker's probe)."""
        self.record(member_id).breaker.on_attempt(now_s)

    def failure(self, member_id: str, now_s: float, kind: FailureKind) -> None:
        """The member failed a request (connect error, 5xx, timeout, a stream broken after the first byte)."""
        self.record(member_id).breaker.on_failure(now_s, kind)

    def success(self, member_id: str) -> None:
        self.record(member_id).breaker.on_success()

    def inconclusive(self, member_id: str) -> None:
        """An attempt that says nothing about the member's health (the client left, our bus failed): a
        half-open breaker's probe is over without a verdict, so the next request may probe."""
        self.record(member_id).breaker.probe_since_s = None

    def is_down(self, member_id: str, now_s: float) -> bool:
        """Excluded by its breaker: open, or half-open with its probe out."""
        return not self.record(member_id).breaker.routable(now_s)


class HeartbeatIntake:
    """Heartbeats into the fleet: the KV bucket's last one per worker at start, then the bus subscription.

    ``load_of(kind, heartbeat, previous)`` is the router's load score (None: no signal), kept per member
    for the /backends sparklines.
    """

    def __init__(self, nc: Client, fleet: Fleet,
                 load_of: Callable[[str, SlotHeartbeat, SlotHeartbeat | None], float | None]) -> None:
        self.nc = nc
        self.fleet = fleet
        self.load_of = load_of

    async def load_known_workers(self) -> None:
        """A new gateway knows the fleet at once from the KV bucket's last heartbeat per worker."""
        try:
            kv = await self.nc.jetstream().key_value(subjects.KV_WORKERS)
            keys = await kv.keys()
        except Exception as exc:  # empty bucket raises NoKeysError; a missing one NotFound
            log.debug("no known workers in KV: %s", exc)
            return
        now = time.time()
        for key in keys:
            with contextlib.suppress(Exception):
                entry = await kv.get(key)
                if entry.value:
                    hb = decode(entry.value, SlotHeartbeat)
                    self.fleet.observe(hb, min(now, hb.ts_s))  # as old as the engine says it is

    async def on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = decode(msg.data, SlotHeartbeat)
        except ProtoDecodeError as exc:
            log.warning("dropped heartbeat on %s: %s", msg.subject, exc.reason)
            return
        now = time.time()
        if self.fleet.observe(hb, now):
            rec = self.fleet.members[hb.worker_id]
            load = self.load_of(hb.engine_kind, hb, rec.previous)
            if load is not None:
                rec.load_history.append(round(load, 3))
