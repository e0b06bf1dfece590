"""Pool routing as pure functions over plain data (docs/routing.md).

No I/O, no clock, no random source of its own: the caller passes ``now_s`` and the member states, and
gets back a ``Pick`` that says who won and why (every candidate's load, cost and cost components), so
the decision can be tested with the arithmetic written out, shown on ``GET /admin/routing/explain``,
and replayed by ``bench/routing_sim.py``.

Per request (O(members) plus O(depth) table look-ups)::

    caller: pick(policy, weights, members, request, affinity, pins, now_s, rng) -> Pick
            try pick.ranked in order (failover: each member once)
            on success: record_route(policy, request, pick, served_by, affinity, pins, now_s)

``pick`` never mutates the tables; ``record_route`` is the only writer on the request path.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from proto import SlotHeartbeat
from services.common.heartbeat_load import VLLM_RUNNING_WEIGHT
from services.gateway.affinity import AffinityHit, AffinityTable, PinTable, PrefixKey, prefix_hashes
from services.gateway.load_score import RoutingWeights, load_score, stale_limit_s

__all__ = [
    "AffinityHit",
    "AffinityTable",
    "Candidate",
    "MemberState",
    "Pick",
    "PinTable",
    "PoolPolicy",
    "PrefixKey",
    "RouteRequest",
    "RoutingWeights",
    "affinity_saving",
    "cache_capacity_chars",
    "load_score",
    "pick",
    "prefix_hashes",
    "record_peer_route",
    "record_route",
    "unseen_bookings",
]

# Prompt characters per token where nothing better is known (the max_context filter; a member before its
# first answer). Per member the gateway measures it from its answers (``MemberState.chars_per_token``,
# fleet.py ``note_prompt``): text at ~5.7 characters per token made a fixed 4 underestimate what a cache
# holds (issue #29: multi-tenant p90 6x worse).
CHARS_PER_TOKEN = 4

# capacity_bias 0.1 (the default) credits a member one open request's cost per route it is behind its weight
CAPACITY_BIAS_SCALE = 10.0

# The energy tie-break switches only for a member at least this much more efficient: equal hardware measures
# J/output-token a few per cent apart by batch size alone, and chasing that concentrates load (bench/routing_sim.py
# with equal watts: shared@0.95 p90 3.9 -> 4.3 s without the floor, a --quick run)
ENERGY_MIN_GAIN = 0.10
# ... and only to a member at most this loaded: past it, the requests it draws queue behind each other (the
# simulator's heterogeneous pool: shared @ 0.8 p90 322 -> 612 ms at margin 0.2 without this bound)
ENERGY_MAX_LOAD = 0.5
# ... and only while the pool is light, the mean load of its routable members under this: with that bound alone
# the rule moved requests at load 0.8 too (a member dips under 0.5 now and then), saving nothing there (J/token
# within 0.5 %) and re-rolling the TTFT p90 of every such cell by up to +33 % (bench/routing_sim.py, 300/300/200/200 W,
# seed 2: chat @ 0.8 119 -> 159 ms); at 0.25 the cells of load 0.8 and 0.95 route as without it (docs/routing.md §3)
ENERGY_MAX_POOL_LOAD = 0.25

_NOT_ROUTABLE = frozenset({"down", "stopped", "draining"})

Reason = Literal[
    "pinned", "affinity", "least_loaded", "overflow", "only_member", "in_flight_only",
    "pin_broken_busy", "pin_broken_down", "no_live_member", "no_member_fits_context",
]
Basis = Literal["heartbeat", "no_signal", "in_flight_only"]


@dataclass(frozen=True)
class PoolPolicy:
    """Per-pool selection knobs; all costs are in load units (a load score lies in [0, 1]).

    ``sticky_bias``: cost subtracted for the session's pinned member (times ``api_key_sticky`` when the
    session key is only the API key id). ``capacity_bias``: how strongly a member's share of recent routes is
    pulled towards its ``capacity_weight``'s share, among members with free lanes (§3, "Weighted split").
    ``max_pool_share`` (0 = off): a member past this share of today's routes ranks after its siblings for
    new conversations (no pin, no cached prefix anywhere), as the Go gateway does. ``affinity_weight``: cost
    subtracted for a cached prefix of ``affinity_full_chars / CHARS_PER_TOKEN`` tokens or more (2,000 by
    default; a member's prefix in characters is read at its measured characters per token; linearly less for
    shorter ones); affinity counts only while the member's load is below ``affinity_busy_guard``. ``backlog_weight``:
    cost per waiting request beyond lanes/2, per lane (the queue the load score no longer sees).
    ``prefill_weight``: cost of prefill already queued by this gateway, at the affinity exchange rate.
    ``energy_margin`` (0 = off): among non-busy members whose cost is within this of the cheapest, the one with
    the lowest measured joules per output token wins (§3, "Energy tie-break").
    Defaults: docs/routing.md §3 (tuned with bench/routing_sim.py, §7).
    """

    overflow_threshold: float = 0.95
    cache_affinity: bool = True
    sticky_bias: float = 0.2
    capacity_bias: float = 0.1
    affinity_busy_guard: float = 0.95
    affinity_weight: float = 0.6
    affinity_full_chars: int = 8000
    backlog_weight: float = 0.5
    prefill_weight: float = 0.5
    api_key_sticky: float = 0.0
    max_pool_share: float = 0.0
    # off by default: in bench/routing_sim.py's heterogeneous pool (300/300/200/200 W, margin 0.1, seeds 1 and 2) the
    # rule of _energy_tiebreak keeps every cell's TTFT p90 within +3 % or +5 ms, but lowers J/output-token only where
    # nothing is shared (unique @ 0.5: -1.9 / -2.1 %); in the sharing cells it moves within the simulation's noise
    # (-0.7 to +1.6 %, bursts @ 0.5 seed 1 up): no measured saving to turn on for everyone (docs/routing.md §3)
    energy_margin: float = 0.0

    def __post_init__(self) -> None:
        for name in ("overflow_threshold", "sticky_bias", "capacity_bias", "affinity_busy_guard", "affinity_weight",
                     "backlog_weight", "prefill_weight", "api_key_sticky", "max_pool_share", "energy_margin"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"PoolPolicy.{name} must lie in [0, 1], got {value!r}")
        if self.affinity_full_chars < 1:
            raise ValueError("PoolPolicy.affinity_full_chars must be positive")


@dataclass(slots=True)  # not frozen: a frozen __init__ costs twice as much, per request
class MemberState:
    """What the gateway knows about one pool member at decision time (the fleet builds these)."""

    member_id: str
    engine_kind: str = "native"
    capacity_weight: float = 1.0
    max_context: int | None = None  # from the pool config; the heartbeat's value is used when None
    heartbeat: SlotHeartbeat | None = None
    previous: SlotHeartbeat | None = None
    received_s: float | None = None
    routed_total: int = 0  # requests this gateway sent in the member's current heartbeat session
    admitted: int | None = None  # heartbeat.admitted_by_gateway[our id]; None: the engine does not say
    in_flight: int = 0  # this gateway's open requests on the member
    is_down: bool = False  # connect errors / 5xx seen recently
    # prompt characters of this gateway's open requests on the member that have not streamed a first
    # token yet, less the cached prefix expected when each was routed (``Candidate.affinity_chars``)
    pending_prefill_chars: int = 0
    # this gateway's routes to the member in this pool: decayed (about the last 100 routes), and today's (UTC)
    recent_routes: float = 0.0
    routes_today: int = 0
    chars_per_token: float | None = None  # measured from this member's answers; None: CHARS_PER_TOKEN
    # members whose heartbeat does not count our requests (``admitted`` None: vLLM, llama.cpp, NInfer): our
    # requests routed after the moment its newest heartbeat describes; None: not tracked (all in-flight booked)
    routed_since_heartbeat: int | None = None
    # requests other gateway replicas announced routing to the member since its newest heartbeat (RouteNotes)
    peer_unseen: int = 0
    # mean seconds one of our requests holds the member (routed -> finished), measured; None: not yet known
    mean_service_s: float | None = None
    # measured energy per output token on this member (its EnergySamples, fleet.py ``note_energy``)
    joules_per_output_token: float | None = None
    # the same at a batch of one (the energy of one decode step): what the energy tie-break compares
    joules_per_step: float | None = None

    def tokens(self, chars: int) -> float:
        """Prompt characters as this member's tokens."""
        return chars / (self.chars_per_token or CHARS_PER_TOKEN)


@dataclass(slots=True)  # not frozen: a frozen __init__ costs twice as much, per request
class RouteRequest:
    session_key: str | None = None  # X-Session-Id, else the API key id
    is_session_header: bool = True  # False: session_key is the API key id (a weaker hint, see api_key_sticky)
    prefix_keys: tuple[PrefixKey, ...] = ()
    prompt_tokens: int = 0  # estimate, for the max_context filter


@dataclass(slots=True)  # not frozen: a frozen __init__ costs twice as much, per request
class Candidate:
    """One member's score sheet (docs/routing.md §3)::

        cost = load + in_flight_term + backlog + pending_prefill - affinity_saving - pin - capacity_term

    ``excluded`` members (``down``/``stopped``/``draining``/``stale``/``context``) have no cost and are not
    in ``Pick.ranked``; ``is_busy`` members (load ≥ overflow_threshold) rank after all others.
    """

    member_id: str
    basis: Basis | None
    load: float
    cost: float | None
    booked: int = 0
    in_flight: int = 0
    in_flight_term: float = 0.0
    affinity_depth: int = 0
    affinity_chars: int = 0
    affinity_saving: float = 0.0
    affinity_guarded: bool = False  # the member holds the prefix but is at or above the busy guard
    pin: float = 0.0
    capacity_term: float = 0.0
    fair_lanes: float | None = None  # weighted split (§3): the member's share of the free members' lanes
    share: float | None = None  # its share of the pool's recent routes, against ``share_target`` (its weight's)
    share_target: float | None = None
    over_pool_share: bool = False  # past max_pool_share of today's routes: ranks after the others for new talks
    backlog: float = 0.0
    pending_prefill: float = 0.0
    wait_s: float | None = None  # expected wait for a lane at a prefix holder (§3, "Bounded wait")
    saved_s: float | None = None  # the prefill its cached prefix saves
    joules_per_output_token: float | None = None
    joules_per_step: float | None = None
    age_s: float | None = None
    is_stale: bool = False
    is_busy: bool = False
    has_free_lane: bool = False  # running + booked < lanes and nothing waiting (no lane signal: our in-flight)
    active: int = 0  # sequences running or booked on it (heartbeat running + booked; no lane signal: our in-flight)
    excluded: str | None = None


@dataclass(slots=True)  # not frozen: a frozen __init__ costs twice as much, per request
class Pick:
    member_id: str | None
    reason: Reason
    ranked: tuple[str, ...]  # failover order: the pick, then the rest by cost (busy ones last)
    candidates: tuple[Candidate, ...]  # every member, in input order
    pinned_member: str | None = None  # the session's live pin when the request came in
    pin_broken: Literal["busy", "down"] | None = None
    energy_over: str | None = None  # the cheapest member, when the energy tie-break chose another


def unseen_bookings(m: MemberState) -> int:
    """Requests routed to the member that its last heartbeat cannot reflect yet (docs/routing.md §2): ours,
    by its admitted count or by what was routed since its heartbeat, plus other replicas' (``peer_unseen``)."""
    if m.admitted is None:
        if m.routed_since_heartbeat is not None:  # no per-gateway count: what was routed after it was taken
            return max(0, min(m.in_flight, m.routed_since_heartbeat)) + m.peer_unseen
        return m.in_flight + m.peer_unseen
    return max(0, min(m.in_flight, m.routed_total - m.admitted)) + m.peer_unseen


def _backlog(m: MemberState, booked: int) -> float:
    """Waiting requests beyond where queueP saturates (lanes/2), per lane: the queue the score cannot see."""
    hb = m.heartbeat
    assert hb is not None and hb.lanes
    waiting = (hb.waiting or 0) + max(0, (hb.running or 0) + booked - hb.lanes)
    return max(0.0, waiting - max(hb.lanes / 2, 1)) / hb.lanes


def _in_flight_lanes(m: MemberState) -> float:
    return m.heartbeat.lanes if m.heartbeat is not None and m.heartbeat.lanes else max(m.capacity_weight, 1.0)


def _in_flight_load(m: MemberState, weights: RoutingWeights) -> float:
    """Load judged from our own open requests only: lanes from the last heartbeat, else capacity_weight."""
    return weights.ninfer_lane_weight * min(m.in_flight / _in_flight_lanes(m), 1.0)


def _in_flight_term(m: MemberState, weights: RoutingWeights) -> float:
    """The cost of our open requests on a no-signal member: like laneP, but without the cap at 1, so a
    cached prefix can attract only a bounded number of extra requests (no herding)."""
    return weights.ninfer_lane_weight * m.in_flight / _in_flight_lanes(m)


def _exclusion(m: MemberState, prompt_tokens: int) -> str | None:
    if m.is_down:
        return "down"
    if m.heartbeat is not None and m.heartbeat.state in _NOT_ROUTABLE:
        return m.heartbeat.state
    max_context = m.max_context or (m.heartbeat.max_context if m.heartbeat is not None else None)
    if max_context and prompt_tokens > max_context:
        return "context"
    return None


def _is_stale(m: MemberState, now_s: float, weights: RoutingWeights) -> bool:
    if m.heartbeat is None:  # a member without telemetry: nothing to go stale (scored by in-flight)
        return False
    return m.received_s is None or now_s - m.received_s > stale_limit_s(m.heartbeat, weights.stale_after_s)


def pick(policy: PoolPolicy, weights: RoutingWeights, members: Sequence[MemberState], request: RouteRequest,
         affinity: AffinityTable | None, pins: PinTable | None, now_s: float,
         rng: random.Random | None = None) -> Pick:
    """Choose a member for one request (docs/routing.md §3). Reads the tables, never writes them.

    ``rng`` is accepted so callers and the simulator share one signature; the policy is deterministic
    and draws nothing from it (ties: larger capacity_weight, then the lower member id).
    """
    del rng
    excluded = {m.member_id: _exclusion(m, request.prompt_tokens) for m in members}
    stale = {m.member_id: _is_stale(m, now_s, weights) for m in members}
    has_fresh = any(excluded[m.member_id] is None and not stale[m.member_id] for m in members)
    eligible = [m for m in members if excluded[m.member_id] is None and not (has_fresh and stale[m.member_id])]

    hits: dict[str, AffinityHit] = {}
    if policy.cache_affinity and affinity is not None and request.prefix_keys and eligible:
        hits = affinity.lookup_members(request.prefix_keys, now_s)
    pinned = pins.get(request.session_key, now_s) if pins is not None and request.session_key else None

    sheets: dict[str, Candidate] = {}
    lanes_of: dict[str, tuple[float, float, float]] = {}  # free members: (lanes, active, lane coefficient)
    # the full affinity credit is earned by affinity_full_chars at CHARS_PER_TOKEN, i.e. in tokens: a prefix is
    # weighed by the prefill it saves on the member that holds it, at that member's characters per token
    full_tokens = policy.affinity_full_chars / CHARS_PER_TOKEN
    prompt_chars = request.prefix_keys[-1].prefix_chars if request.prefix_keys else 0
    waits: dict[str, float] = {}
    min_wait_s = None
    if hits:  # the wait for a lane each member would impose; the least of them is paid wherever the request goes
        for m in eligible:
            w = _lane_wait_s(m, now_s, weights)
            if w is not None:
                waits[m.member_id] = w
        min_wait_s = min(waits.values(), default=None)
    for m in members:
        mid = m.member_id
        age_s = now_s - m.received_s if m.heartbeat is not None and m.received_s is not None else None
        exclusion = excluded[mid] or ("stale" if has_fresh and stale[mid] else None)
        if exclusion is not None:
            sheets[mid] = Candidate(mid, None, 0.0, None, in_flight=m.in_flight, age_s=age_s,
                                    is_stale=stale[mid], excluded=exclusion)
            continue
        booked = unseen_bookings(m)
        basis: Basis
        in_flight_term = 0.0
        if stale[mid]:
            basis, load = "in_flight_only", _in_flight_load(m, weights)
        else:
            score = None if m.heartbeat is None else load_score(m.engine_kind, m.heartbeat, m.previous, booked,
                                                                 weights)
            if score is None:  # no signal: load 0.0 (overflow never triggers), spread by our in-flight
                basis, load, in_flight_term = "no_signal", 0.0, _in_flight_term(m, weights)
            else:
                basis, load = "heartbeat", score
        hit = hits.get(mid)
        saving, guarded = 0.0, False
        wait_s = saved_s = None
        if hit is not None:
            if load < policy.affinity_busy_guard:
                saving = affinity_saving(policy, m, hit.prefix_chars, prompt_chars)
                wait_s = waits.get(mid) if basis == "heartbeat" else None
                saved_s = _prefill_saved_s(m, hit.prefix_chars)
                if wait_s is not None and min_wait_s == 0.0 and saved_s is not None and wait_s > saved_s:
                    # a lane is free elsewhere: a hit is worth waiting for only as long as the prefill it saves
                    # (§3, "Bounded wait"; with every member queued a miss lengthens everyone's wait, no bound)
                    saving *= saved_s / wait_s
            else:
                guarded = True
        is_busy = load >= policy.overflow_threshold
        pin = 0.0
        if mid == pinned and not is_busy:
            pin = policy.sticky_bias * (1.0 if request.is_session_header else policy.api_key_sticky)
        backlog = policy.backlog_weight * _backlog(m, booked) if basis == "heartbeat" else 0.0
        prefill = policy.prefill_weight * policy.affinity_weight * m.tokens(m.pending_prefill_chars) / full_tokens
        cost = load + in_flight_term + backlog + prefill - saving - pin
        free = None if is_busy else _free_lanes(m, basis, booked, weights)
        hb = m.heartbeat
        active = (hb.running or 0) + booked if basis == "heartbeat" and hb is not None else m.in_flight
        if free is not None:
            lanes_of[mid] = free
        sheets[mid] = Candidate(
            mid, basis, load, cost, booked=booked, in_flight=m.in_flight, in_flight_term=in_flight_term,
            affinity_depth=hit.depth if hit else 0, affinity_chars=hit.prefix_chars if hit else 0,
            affinity_saving=saving, affinity_guarded=guarded, pin=pin,
            backlog=backlog, pending_prefill=prefill, wait_s=wait_s, saved_s=saved_s,
            joules_per_output_token=m.joules_per_output_token, joules_per_step=m.joules_per_step, age_s=age_s,
            is_stale=stale[mid], is_busy=is_busy, has_free_lane=free is not None, active=active,
        )
    _weighted_split(policy, [m for m in eligible if m.member_id in lanes_of], lanes_of, sheets)
    if policy.max_pool_share > 0 and pinned is None and not hits:
        _mark_over_pool_share(policy.max_pool_share, eligible, sheets)

    candidates = tuple(sheets[m.member_id] for m in members)
    pin_broken: Literal["busy", "down"] | None = None
    if pinned is not None:
        sheet = sheets.get(pinned)
        if sheet is None or sheet.excluded is not None:
            pin_broken = "down"
        elif sheet.is_busy:
            pin_broken = "busy"
    if not eligible:
        only_context = bool(members) and all(c.excluded == "context" for c in candidates if c.excluded)
        reason: Reason = "no_member_fits_context" if only_context else "no_live_member"
        return Pick(None, reason, (), candidates, pinned, pin_broken)

    capacity = {m.member_id: m.capacity_weight for m in eligible}

    def order(c: Candidate) -> tuple[bool, bool, float, float, float, str]:
        # not busy before busy (overflow), within max_pool_share before past it; then cost, our in-flight share,
        # bigger capacity, lower id
        assert c.cost is not None
        weight = max(capacity[c.member_id], 1e-9)
        return (c.is_busy, c.over_pool_share, c.cost, c.in_flight / weight, -capacity[c.member_id], c.member_id)

    ranked = tuple(sorted((sheets[m.member_id] for m in eligible), key=order))
    energy_over = None
    greener = _energy_tiebreak(policy.energy_margin, ranked)
    if greener is not None:
        energy_over = ranked[0].member_id
        ranked = (greener, *(c for c in ranked if c is not greener))
    winner = ranked[0]
    if pin_broken is not None:
        reason = "pin_broken_busy" if pin_broken == "busy" else "pin_broken_down"
    elif len(ranked) == 1:
        reason = "only_member"
    elif winner.basis == "in_flight_only":
        reason = "in_flight_only"
    elif winner.is_busy:
        reason = "overflow"
    elif winner.pin > 0:
        reason = "pinned"
    elif winner.affinity_saving > 0:
        reason = "affinity"
    else:
        reason = "least_loaded"
    return Pick(winner.member_id, reason, tuple(c.member_id for c in ranked), candidates, pinned, pin_broken,
                energy_over)


def affinity_saving(policy: PoolPolicy, m: MemberState, matched_chars: int, prompt_chars: int) -> float:
    """The affinity credit of a member holding ``matched_chars`` of a ``prompt_chars`` prompt (§3)::

        saving = affinity_weight * matched_tokens / max(full_tokens, prompt_tokens)

    in the member's tokens (``full_tokens = affinity_full_chars / CHARS_PER_TOKEN``, 2,000). Up to full_tokens
    that is the old ``min(matched / full, 1)``; past it the credit is the share of the prompt the member holds,
    so a long conversation's own engine (all but the last turn) stays clearly cheaper than one holding only its
    system prompt (issue #29: with the cap, both earned the full credit once the system prompt was ~8,000
    characters, and chat without X-Session-Id lost to the Go gateway's content affinity)."""
    full_tokens = policy.affinity_full_chars / CHARS_PER_TOKEN
    scale = max(full_tokens, m.tokens(prompt_chars))
    return policy.affinity_weight * min(m.tokens(matched_chars) / scale, 1.0)


def _lane_wait_s(m: MemberState, now_s: float, weights: RoutingWeights) -> float | None:
    """The expected wait for a lane on a member with a fresh lane-counting heartbeat, in seconds; None where
    not known: the requests that must finish before a new one gets a lane (running + booked + waiting - lanes
    + 1), one lane freeing every ``mean_service_s / lanes`` (the fleet's measured mean time per request)."""
    hb = m.heartbeat
    if hb is None or not hb.lanes or hb.running is None or m.mean_service_s is None or _is_stale(m, now_s, weights):
        return None
    ahead = hb.running + unseen_bookings(m) + (hb.waiting or 0) - hb.lanes + 1
    return max(0, ahead) * m.mean_service_s / hb.lanes


def _prefill_saved_s(m: MemberState, matched_chars: int) -> float | None:
    """The prefill a cached prefix saves, in seconds: its tokens at the member's reported prefill rate."""
    rate = m.heartbeat.prefill_tok_per_s if m.heartbeat is not None else None
    return m.tokens(matched_chars) / rate if rate else None


def _energy_tiebreak(margin: float, ranked: Sequence[Candidate]) -> Candidate | None:
    """§3 "Energy tie-break": the member with the lowest measured energy per decode step (J/output-token at a batch
    of one, fleet.py ``note_energy``) among those that would serve the request as soon as the cheapest would, when
    that is :data:`ENERGY_MIN_GAIN` lower than the cheapest's own; None: the cheapest stays. Only while the pool is
    light (mean load under :data:`ENERGY_MAX_POOL_LOAD`) and the cheapest holds no pin for the session. A member
    qualifies when it is not busy, its cost is within ``margin`` of the cheapest's, its load under
    :data:`ENERGY_MAX_LOAD`, it has a free lane and nothing waiting, no more prefill queued than the cheapest, at
    least the cheapest's cached prefix, is not past max_pool_share, and both it and the cheapest are running
    something: an idle member pays a whole decode step per token, a running one only the step's growth with one
    more sequence, and moves between idle members at light load (bursts' off phases) placed prefixes for nothing
    (bursts @ 0.8, seed 2: p90 +7.3 %). Only members with a measured figure compete (an unmeasured one is never
    assumed efficient)."""
    if margin <= 0 or len(ranked) < 2 or ranked[0].is_busy or ranked[0].joules_per_step is None:
        return None
    best = ranked[0]
    assert best.cost is not None
    if best.pin > 0 or best.active == 0 or sum(c.load for c in ranked) / len(ranked) >= ENERGY_MAX_POOL_LOAD:
        return None
    greener = min((c for c in ranked[1:] if not c.is_busy and c.cost is not None and c.cost <= best.cost + margin
                   and c.load < ENERGY_MAX_LOAD and c.has_free_lane and c.pending_prefill <= best.pending_prefill
                   and c.affinity_saving >= best.affinity_saving and not c.over_pool_share
                   and c.active > 0 and c.joules_per_step is not None),
                  key=lambda c: c.joules_per_step or 0.0, default=None)
    if greener is None or greener.joules_per_step is None:
        return None
    assert best.joules_per_step is not None
    return greener if greener.joules_per_step < (1 - ENERGY_MIN_GAIN) * best.joules_per_step else None


def _free_lanes(m: MemberState, basis: Basis, booked: int, weights: RoutingWeights
                ) -> tuple[float, float, float] | None:
    """(lanes, requests on them, the load formula's coefficient of running/lanes) for a member that has a free
    lane; None when it has none. A member without a lane signal counts as free (nothing says otherwise), its
    lanes guessed as for in_flight_term."""
    hb = m.heartbeat
    if basis == "heartbeat":
        assert hb is not None and hb.lanes and hb.running is not None
        active = hb.running + booked
        if active >= hb.lanes or (hb.waiting or 0) > 0:
            return None
        coefficient = VLLM_RUNNING_WEIGHT if m.engine_kind == "vllm" else weights.ninfer_lane_weight
        return float(hb.lanes), float(active), coefficient
    lanes = _in_flight_lanes(m)
    if basis == "in_flight_only" and m.in_flight >= lanes:
        return None
    return lanes, float(m.in_flight), weights.ninfer_lane_weight


def _weighted_split(policy: PoolPolicy, free: list[MemberState], lanes_of: dict[str, tuple[float, float, float]],
                    sheets: dict[str, Candidate]) -> None:
    """§3 "Weighted split": among members with a free lane whose capacity weights differ, traffic follows the
    weights. Each one's lane occupancy is measured against its weight's share of those members' lanes
    (``fair_lanes``: 3:1 weights over 8 + 8 lanes are 12 and 4), so concurrent requests settle 3:1; and
    ``capacity_term`` pulls its share of the pool's recent routes towards its weight's share, which splits
    sequential requests to idle members 3:1 too. Equal weights: nothing changes (each member's own lanes)."""
    if len(free) < 2 or len({m.capacity_weight for m in free}) < 2:
        return
    total_weight = sum(m.capacity_weight for m in free)
    total_lanes = sum(lanes_of[m.member_id][0] for m in free)
    recent = sum(m.recent_routes for m in free)
    for m in free:
        sheet = sheets[m.member_id]
        assert sheet.cost is not None
        lanes, active, coefficient = lanes_of[m.member_id]
        target = m.capacity_weight / total_weight
        fair = total_lanes * target
        if fair > 0:
            sheet.cost += coefficient * active / fair - coefficient * active / lanes
            sheet.fair_lanes = fair
        sheet.share_target = target
        if recent > 0 and fair > 0:
            sheet.share = m.recent_routes / recent
            # routes behind its weight's share of the recent ones, each credited as one of its open requests (at
            # the default capacity_bias 0.1); bounded so a fully cached prefix still wins over the split
            behind = target * recent - m.recent_routes
            credit = CAPACITY_BIAS_SCALE * policy.capacity_bias * behind * coefficient / fair
            bound = policy.affinity_weight / 2
            sheet.capacity_term = max(-bound, min(bound, credit))
            sheet.cost -= sheet.capacity_term


def _mark_over_pool_share(max_share: float, eligible: Sequence[MemberState], sheets: dict[str, Candidate]) -> None:
    """The Go gateway's soft fairness cap: a member past ``max_share`` of the pool's routes today ranks after
    its non-busy siblings for a new conversation (existing ones keep their member: pins and affinity win)."""
    today = sum(m.routes_today for m in eligible)
    if today == 0:
        return
    over = [m.member_id for m in eligible if m.routes_today / today > max_share]
    if len(over) < len(eligible):
        for mid in over:
            sheets[mid].over_pool_share = True


def cache_capacity_chars(hb: SlotHeartbeat | None, chars_per_token: float | None = None) -> int | None:
    """How much prompt text a member's KV cache holds: its heartbeat's capacity in tokens at the member's
    measured characters per token (else :data:`CHARS_PER_TOKEN`); None when it does not say."""
    if hb is None or not hb.kv_capacity_tokens:
        return None
    return int(hb.kv_capacity_tokens * (chars_per_token or CHARS_PER_TOKEN))


def record_peer_route(policy: PoolPolicy, prefix_keys: Sequence[PrefixKey], session_key: str | None,
                      served_by: str, affinity: AffinityTable | None, pins: PinTable | None, now_s: float,
                      capacity_chars: int | None = None) -> None:
    """Another gateway replica's request reached its first byte on ``served_by`` (its RouteNote): the member now
    holds these prefixes, and the session (if the note names one) is there, as if this gateway had routed it
    (docs/routing.md §6: replicas that learnt only their own routes split each tenant's prefix over the pool)."""
    if policy.cache_affinity and affinity is not None and prefix_keys:
        affinity.record(prefix_keys, served_by, now_s, capacity_chars)
    if pins is not None and session_key:
        pins.pin(session_key, served_by, now_s)


def record_route(policy: PoolPolicy, request: RouteRequest, pick_: Pick, served_by: str,
                 affinity: AffinityTable | None, pins: PinTable | None, now_s: float,
                 capacity_chars: int | None = None) -> None:
    """After ``served_by`` (the pick, or a failover member from ``pick_.ranked``) accepted the request.

    Records every prefix depth for ``served_by`` (it now holds them; ``capacity_chars``, from
    :func:`cache_capacity_chars`, bounds what the table credits it with) and keeps the session pinned: an
    honoured pin stays where it was (even if a cheaper member won this time, the pin is only broken by
    busy or down); a broken, missing or failed-over pin moves to ``served_by``.
    """
    if policy.cache_affinity and affinity is not None and request.prefix_keys:
        affinity.record(request.prefix_keys, served_by, now_s, capacity_chars)
    if pins is None or not request.session_key:
        return
    keep = pick_.pinned_member is not None and pick_.pin_broken is None and served_by == pick_.member_id
    pins.pin(request.session_key, pick_.pinned_member if keep and pick_.pinned_member else served_by, now_s)
