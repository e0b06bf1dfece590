"""Gateway replicas share their routes over the bus (docs/routing.md §6).

Each replica sees only its own in-flight requests and learns affinity only from its own routes: with 4 replicas
behind a load balancer, a tenant's prefix ended up on every member and bursts herded between heartbeats
(bench/routing_sim.py ``--gateways 4 --no-share``: shared@0.8 TTFT p90 2.0 s against 0.3 s for one gateway).
So every replica announces, on ``llm.v1.route.<gateway_id>``:

- ``routed``: a request went to a member. Receivers book it (``Fleet.note_peer_route``) until that member's
  heartbeat describes a moment after it (then its running/waiting hold it), and count the prefill it queues
  there until ``prefill_done`` (its first byte, or the attempt's end);
- ``first_byte``: the member streamed the first byte, so it holds the prompt's prefixes; receivers record
  them in their affinity table, and the session's pin when the request named an ``X-Session-Id``.

Notes are buffered by the request path (no await there) and published in batches every ``interval_s`` by
:meth:`RouteSharing.run`; a lost batch costs only routing quality, never correctness.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.client import Client
from nats.aio.msg import Msg

from proto import ProtoDecodeError, RouteNote, RouteNotes, decode, encode, subjects
from services.gateway import routing
from services.gateway.affinity import PrefixKey
from services.gateway.fleet import Fleet
from services.gateway.routing_adapter import Decision, Router

log = logging.getLogger(__name__)

SHARE_INTERVAL_S = 0.02  # a heartbeat is 0.25-1 s: notes 20 ms late still arrive long before it
MAX_PENDING_NOTES = 10_000  # a bus outage must not grow the buffer without bound (the oldest are dropped)


class RouteSharing:
    def __init__(self, nc: Client, gateway_id: str, session_id: str, fleet: Fleet, router: Router,
                 interval_s: float = SHARE_INTERVAL_S) -> None:
        self.nc = nc
        self.gateway_id = gateway_id
        self.session_id = session_id
        self.fleet = fleet
        self.router = router
        self.interval_s = interval_s
        self._pending: list[RouteNote] = []
        self._seq = 0

    # ---- the request path (sync) ----------------------------------------------------------------
    def _add(self, note: RouteNote) -> None:
        self._pending.append(note)
        if len(self._pending) > MAX_PENDING_NOTES:
            del self._pending[: len(self._pending) - MAX_PENDING_NOTES]

    def routed(self, member_id: str, routed_s: float, pending_chars: int = 0) -> None:
        self._add(RouteNote(kind="routed", member_id=member_id, routed_s=routed_s, pending_chars=pending_chars))

    def prefill_done(self, member_id: str, pending_chars: int, now_s: float) -> None:
        if pending_chars:
            self._add(RouteNote(kind="prefill_done", member_id=member_id, routed_s=now_s,
                                pending_chars=pending_chars))

    def first_byte(self, decision: Decision, member_id: str, now_s: float) -> None:
        request = decision.request
        prefix = [(k.digest, k.depth, k.prefix_chars) for k in request.prefix_keys] \
            if decision.policy.cache_affinity else []
        session_key = request.session_key if request.is_session_header else None
        if prefix or session_key:
            self._add(RouteNote(kind="first_byte", member_id=member_id, routed_s=now_s, prefix=prefix,
                                session_key=session_key))

    # ---- the bus --------------------------------------------------------------------------------
    async def flush(self) -> None:
        if not self._pending:
            return
        notes, self._pending = self._pending, []
        self._seq += 1
        message = RouteNotes(gateway_id=self.gateway_id, session_id=self.session_id, seq=self._seq,
                             ts_s=time.time(), notes=notes)
        await self.nc.publish(subjects.route(self.gateway_id), encode(message))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.flush()
            except Exception as exc:  # a closed or reconnecting connection: these notes are lost, the next go
                log.debug("route notes not published: %s", exc)

    async def on_notes(self, msg: Msg) -> None:
        try:
            message = decode(msg.data, RouteNotes)
        except ProtoDecodeError as exc:
            log.warning("dropped route notes on %s: %s", msg.subject, exc.reason)
            return
        if message.gateway_id == self.gateway_id:
            return
        self.apply(message, time.time())

    def apply(self, message: RouteNotes, now_s: float) -> None:
        """Another replica's notes into this gateway's fleet bookings and routing tables."""
        for note in message.notes:
            if note.kind == "routed":
                self.fleet.note_peer_route(note.member_id, note.routed_s)
                self.fleet.add_pending_prefill(note.member_id, note.pending_chars)
                continue
            if note.kind == "prefill_done":
                self.fleet.add_pending_prefill(note.member_id, -note.pending_chars)
                continue
            rec = self.fleet.record(note.member_id)
            keys = tuple(PrefixKey(str(d), int(depth), int(chars)) for d, depth, chars in note.prefix)
            routing.record_peer_route(PEER_POLICY, keys, note.session_key, note.member_id, self.router.affinity,
                                      self.router.pins, now_s,
                                      routing.cache_capacity_chars(rec.heartbeat, rec.chars_per_token))


# the sender applied its pool's cache_affinity already (no prefix sent when off)
PEER_POLICY = routing.PoolPolicy()
