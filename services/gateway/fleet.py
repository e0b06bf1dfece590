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

from proto import EnergySample, ProtoDecodeError, SlotHeartbeat, decode, subjects
from services.gateway.breaker import BASE_COOLDOWN_S, Breaker, FailureKind

log = logging.getLogger(__name__)

BUS_BACKEND = "nats"
DOWN_AFTER_FAILURE_S = BASE_COOLDOWN_S  # a member that failed a request is skipped at least this long
HISTORY_POINTS = 60
CPT_MIN_TOKENS = 32  # prompts at least this long teach the gateway a member's characters per token
CPT_ALPHA = 0.1  # the weight of each new prompt in the running average
CPT_BOUNDS = (1.0, 12.0)  # clamp: a garbled count cannot make a cache look empty or infinite
SERVICE_ALPHA = 0.05  # mean_service_s: the weight of each finished request (about the last 20)
ENERGY_ALPHA = 0.2  # joules_per_output_token: the weight of each energy interval


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
    # when each of our requests since the newest heartbeat's moment was routed (for members that do not count
    # our requests per gateway: fleet.unseen); trimmed at every heartbeat
    route_times: collections.deque[float] = field(default_factory=collections.deque)
    # when each route another gateway replica announced to this member was made (RouteNote, kind "routed"): its
    # heartbeat cannot hold those either; trimmed at every heartbeat like route_times
    peer_route_times: collections.deque[float] = field(default_factory=collections.deque)
    mean_service_s: float | None = None  # routed -> finished, an average over recent requests
    joules_per_output_token: float | None = None  # from the member's EnergySamples (note_energy)
    energy_mark: tuple[str, float, dict[str, int]] | None = None  # last sample: (session, ts, device -> mJ)
    # joules per output token at a batch of one: J/output-token times the mean running sequences over the same
    # interval, i.e. the energy of one decode step (note_energy). J/output-token itself mostly measures batch size
    # (one sequence per step costs ~6x the energy per token of eight), so it cannot compare members' hardware.
    joules_per_step: float | None = None
    running_area: float = 0.0  # running sequences x seconds since the last energy sample (heartbeats' running)
    running_at: tuple[float, int] | None = None  # (ts, running) of the newest heartbeat


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
        self._integrate_running(rec, hb.ts_s)
        rec.running_at = (hb.ts_s, hb.running) if hb.running is not None else None  # unknown: no per-step figure
        # what the heartbeat describes: the moment it was taken (its ts), or when it came if its clock runs ahead
        taken_s = min(hb.ts_s, now_s)
        while rec.route_times and rec.route_times[0] <= taken_s:
            rec.route_times.popleft()
        while rec.peer_route_times and rec.peer_route_times[0] <= taken_s:
            rec.peer_route_times.popleft()
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

    def unseen(self, member_id: str) -> int | None:
        """For a member whose heartbeat does not count our requests (``admitted`` None): how many of ours were
        routed after the moment its newest heartbeat describes (its running/waiting cannot hold them yet);
        None for one that counts them (book by ``admitted``) or has no heartbeat (every open request counts)."""
        rec = self.record(member_id)
        if rec.heartbeat is None or self.admitted(member_id) is not None:
            return None
        return len(rec.route_times)

    def note_peer_route(self, member_id: str, routed_s: float) -> None:
        """Another gateway replica routed a request to the member at ``routed_s`` (its RouteNote)."""
        times = self.record(member_id).peer_route_times
        if times and routed_s < times[-1]:  # notes from several peers interleave: keep the deque ordered
            times.append(routed_s)
            ordered = sorted(times)
            times.clear()
            times.extend(ordered)
        else:
            times.append(routed_s)

    def peer_unseen(self, member_id: str) -> int:
        """Requests other replicas routed to the member after the moment its newest heartbeat describes."""
        rec = self.record(member_id)
        if rec.heartbeat is None:
            return 0
        taken_s = min(rec.heartbeat.ts_s, rec.received_s or rec.heartbeat.ts_s)
        return sum(1 for t in rec.peer_route_times if t > taken_s)

    def book(self, member_id: str, now_s: float | None = None) -> None:
        """A request goes to the member at ``now_s`` (wall clock, as heartbeats' ``ts_s``; None: untimed)."""
        rec = self.record(member_id)
        rec.routed_total += 1
        rec.in_flight += 1
        if now_s is not None:
            rec.route_times.append(now_s)

    def unbook(self, member_id: str) -> None:
        """The member refused before admitting (429, connect error): it will never count this one."""
        rec = self.record(member_id)
        rec.routed_total = max(0, rec.routed_total - 1)
        if rec.route_times:
            rec.route_times.pop()

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

    def release(self, member_id: str, service_s: float | None = None) -> None:
        """One of our requests on the member is over; ``service_s``: how long it held the member (an answer
        that finished; None for one cut short or refused), averaged into ``mean_service_s``."""
        rec = self.record(member_id)
        if rec.in_flight > 0:
            rec.in_flight -= 1
        if service_s is not None and service_s >= 0:
            rec.mean_service_s = service_s if rec.mean_service_s is None else (
                (1 - SERVICE_ALPHA) * rec.mean_service_s + SERVICE_ALPHA * service_s)

    def note_energy(self, sample: EnergySample) -> None:
        """The member's energy sample (``llm.v1.energy.<worker_id>``): the joules its devices used since its
        previous sample over the output tokens it produced in between, averaged into
        ``joules_per_output_token``. Intervals without tokens (idle) or with a device unreadable, reset
        (counter down) or restarted (another session) teach nothing, as accounting leaves them out of J/token."""
        rec = self.record(sample.worker_id)
        counters = {r.device_id: r.energy_mj for r in sample.readings if r.energy_mj is not None}
        mark, rec.energy_mark = rec.energy_mark, (sample.session_id, sample.ts_s, counters)
        self._integrate_running(rec, sample.ts_s)
        area, rec.running_area = rec.running_area, 0.0
        tokens = sum(t.output_tokens for t in sample.request_tokens)
        if mark is None or mark[0] != sample.session_id or sample.ts_s <= mark[1] or tokens <= 0 or not counters:
            return
        if set(counters) != set(mark[2]) or any(counters[d] < mark[2][d] for d in counters):
            return
        jpt = sum(counters[d] - mark[2][d] for d in counters) / 1000.0 / tokens
        rec.joules_per_output_token = jpt if rec.joules_per_output_token is None else (
            (1 - ENERGY_ALPHA) * rec.joules_per_output_token + ENERGY_ALPHA * jpt)
        mean_running = area / (sample.ts_s - mark[1])
        if mean_running > 0:  # no heartbeat said anything ran: the interval cannot be normalised
            jps = jpt * mean_running
            rec.joules_per_step = jps if rec.joules_per_step is None else (
                (1 - ENERGY_ALPHA) * rec.joules_per_step + ENERGY_ALPHA * jps)

    @staticmethod
    def _integrate_running(rec: MemberRecord, ts_s: float) -> None:
        """Add the newest heartbeat's running count, held from its moment to ``ts_s``, to ``running_area``."""
        if rec.running_at is not None and ts_s > rec.running_at[0]:
            rec.running_area += rec.running_at[1] * (ts_s - rec.running_at[0])
            rec.running_at = (ts_s, rec.running_at[1])

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

    async def on_energy(self, msg: Msg) -> None:
        """Energy samples (core subscription on the ENERGY stream's subjects): each member's J/output-token."""
        try:
            sample = decode(msg.data, EnergySample)
        except ProtoDecodeError as exc:
            log.debug("dropped energy sample on %s: %s", msg.subject, exc.reason)
            return
        self.fleet.note_energy(sample)

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
