"""services/gateway/routing.py and affinity.py: the rules of docs/routing.md, arithmetic written out."""

from __future__ import annotations

import json
from collections import Counter

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proto import SlotHeartbeat
from services.gateway.fleet import Fleet
from services.gateway.load_score import stale_limit_s
from services.gateway.routing import (
    AffinityTable,
    MemberState,
    PinTable,
    PoolPolicy,
    RouteRequest,
    RoutingWeights,
    cache_capacity_chars,
    load_score,
    pick,
    prefix_hashes,
    record_route,
    unseen_bookings,
)

W = RoutingWeights()
NOW = 100.5
# only the load and the term under test: no capacity, backlog or prefill terms
PLAIN = PoolPolicy(overflow_threshold=0.85, capacity_bias=0.0, backlog_weight=0.0, prefill_weight=0.0)


def hb(wid: str = "a", *, kind: str = "ninfer", lanes: int | None = 8, running: int | None = 0,
       waiting: int | None = 0, kv: float | None = 0.0, evictions: int | None = 0, spills: int | None = None,
       preemptions: int | None = None, seq: int = 1, session: str = "s", state: str = "ready",
       max_context: int | None = None) -> SlotHeartbeat:
    return SlotHeartbeat(worker_id=wid, session_id=session, seq=seq, ts_s=0.0, model_id="m", engine_kind=kind,  # type: ignore[arg-type]
                         lanes=lanes, running=running, waiting=waiting, kv_usage=kv, kv_evictions_total=evictions,
                         kv_spills_total=spills, preemptions_total=preemptions, state=state,  # type: ignore[arg-type]
                         max_context=max_context)


def member(h: SlotHeartbeat | None, mid: str | None = None, *, received_s: float | None = 100.0, routed: int = 0,
           admitted: int | None = 0, in_flight: int = 0, previous: SlotHeartbeat | None = None,
           capacity: float = 1.0, is_down: bool = False, max_context: int | None = None,
           pending_chars: int = 0) -> MemberState:
    member_id = mid or (h.worker_id if h is not None else "x")
    return MemberState(member_id=member_id, engine_kind=h.engine_kind if h is not None else "stock",
                       capacity_weight=capacity, max_context=max_context, heartbeat=h, previous=previous,
                       received_s=received_s if h is not None else None, routed_total=routed, admitted=admitted,
                       in_flight=in_flight, is_down=is_down, pending_prefill_chars=pending_chars)


def choose(members: list[MemberState], request: RouteRequest = RouteRequest(), policy: PoolPolicy = PLAIN,
           affinity: AffinityTable | None = None, pins: PinTable | None = None, now_s: float = NOW):
    return pick(policy, W, members, request, affinity, pins, now_s, None)


def sheet(p, mid: str):
    return next(c for c in p.candidates if c.member_id == mid)


def conversation(*contents: str) -> list[dict[str, str]]:
    roles = ["system"] + ["user", "assistant"] * len(contents)
    return [{"role": r, "content": c} for r, c in zip(roles, contents, strict=False)]


# --- §1 load scores -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("running", "waiting", "kv", "expected"), [
    (0, 0, 0.0, 0.0),
    (4, 0, 0.0, 0.75 * 4 / 8),
    (8, 0, 0.0, 0.75 * 1),
    (8, 2, 0.0, 0.75 * 1 + 0.15 * 2 / 4),
    (2, 1, 0.0, 0.75 * 1 + 0.15 * 1 / 4),  # anything waiting makes laneP 1
    (8, 9, 0.0, 0.75 * 1 + 0.15 * 1),  # queueP saturates at lanes/2 waiting
    (4, 0, 0.5, 0.75 * 4 / 8),  # KV below the high-water mark counts nothing
    (4, 0, 0.95, 0.75 * 4 / 8 + 0.10 * 0.95),
])
def test_the_ninfer_score_is_the_design_formula_parity_table(running, waiting, kv, expected) -> None:
    assert load_score("ninfer", hb(running=running, waiting=waiting, kv=kv), None, 0, W) == pytest.approx(expected)
    assert load_score("native", hb(running=running, waiting=waiting, kv=kv), None, 0, W) == pytest.approx(expected)


@pytest.mark.parametrize(("kind", "counter"), [("ninfer", "spills"), ("ninfer", "preemptions"),
                                               ("native", "spills"), ("native", "preemptions"),
                                               ("ninfer", "evictions")])
def test_kv_pressure_is_one_when_a_counter_rose_within_the_same_heartbeat_session(kind: str, counter: str) -> None:
    before = hb(**{counter: 3}, seq=1)
    after = hb(**{counter: 5}, seq=2, running=4)
    assert load_score(kind, after, before, 0, W) == pytest.approx(0.75 * 4 / 8 + 0.10 * 1)
    restarted = hb(**{counter: 3}, seq=1, session="older")
    assert load_score(kind, after, restarted, 0, W) == pytest.approx(0.75 * 4 / 8)


def test_our_engines_lru_evictions_of_cached_blocks_are_not_pressure() -> None:
    # issue #29: a full prefix cache evicts an unused block on every new prefill; that is not load
    # our engine heartbeats as kind "native" (services/engine/serve/worker.py)
    before = hb(evictions=100, seq=1, kind="native")
    after = hb(evictions=140, seq=2, running=4, kind="native")
    assert load_score("native", after, before, 0, W) == pytest.approx(0.75 * 4 / 8)


@pytest.mark.parametrize(("running", "waiting", "kv", "expected"), [
    (0, 0, 0.0, 0.0),
    (4, 0, 0.5, 0.6 * 4 / 8 + 0.3 * 0.5),
    (8, 3, 0.9, 0.6 * 8 / 8 + 0.3 * 0.9 + 0.1 * 3 / 5),
    (8, 12, 1.0, 0.6 * 1 + 0.3 * 1.0 + 0.1 * 5 / 5),  # waiting counts up to 5
    (2, 0, None, 0.6 * 2 / 8),  # no KV signal counts as 0
])
def test_the_vllm_score_is_the_interop_formula_parity_table(running, waiting, kv, expected) -> None:
    assert load_score("vllm", hb(kind="vllm", running=running, waiting=waiting, kv=kv), None, 0, W) == pytest.approx(
        expected)


@pytest.mark.parametrize("kind", ["stock"])
def test_engines_without_a_lane_signal_have_no_score_and_load_zero(kind: str) -> None:
    assert load_score(kind, hb(kind=kind, running=5), None, 0, W) is None
    p = choose([member(hb("a", kind=kind, running=5))])
    assert sheet(p, "a").load == 0.0 and sheet(p, "a").basis == "no_signal"


@pytest.mark.parametrize("kind", ["llamacpp", "sglang"])
def test_llamacpp_slots_and_sglang_running_requests_are_lanes_scored_by_the_lane_formula(kind: str) -> None:
    # llama.cpp: 4 slots, all processing, 3 deferred (the issue-24 shape); the lane formula, as for our engines
    busy = hb("busy", kind=kind, lanes=4, running=4, waiting=3, kv=0.95)
    idle = hb("idle", kind=kind, lanes=4, running=0, waiting=0, kv=0.1)
    assert load_score(kind, busy, None, 0, W) == pytest.approx(0.75 + 0.15 * 1.0 + 0.10 * 0.95)
    assert load_score(kind, idle, None, 0, W) == 0.0
    assert load_score(kind, hb(kind=kind, lanes=None, running=2), None, 0, W) is None  # no slot count: no signal
    p = choose([member(busy), member(idle)])
    assert p.member_id == "idle" and sheet(p, "busy").load > sheet(p, "idle").load


def test_a_ninfer_heartbeat_without_lanes_is_no_signal_too() -> None:
    assert load_score("ninfer", hb(lanes=None, running=None), None, 0, W) is None


# --- §2 in-flight booking -------------------------------------------------------------------------------
def test_only_bookings_the_heartbeat_has_not_seen_are_added() -> None:
    assert unseen_bookings(member(hb(), routed=5, admitted=3, in_flight=4)) == 5 - 3
    assert unseen_bookings(member(hb(), routed=5, admitted=3, in_flight=1)) == 1  # capped by what is open
    assert unseen_bookings(member(hb(), routed=5, admitted=5, in_flight=4)) == 0
    assert unseen_bookings(member(hb(), routed=5, admitted=None, in_flight=4)) == 4  # the engine does not say


def test_booked_requests_fill_free_lanes_then_wait() -> None:
    # 6 running + 4 unseen bookings on 8 lanes: 8 running, 2 waiting
    m = member(hb(running=6), routed=4, admitted=0, in_flight=4)
    assert sheet(choose([m]), "a").load == pytest.approx(0.75 * 1 + 0.15 * 2 / 4)
    assert sheet(choose([m]), "a").booked == 4


# --- §3 eligibility -------------------------------------------------------------------------------------
def test_a_stale_member_is_excluded_while_a_fresh_one_exists() -> None:
    stale = member(hb("a"), received_s=NOW - 3.5)
    fresh = member(hb("b", running=7))
    p = choose([stale, fresh])
    assert p.member_id == "b" and p.ranked == ("b",)
    assert sheet(p, "a").excluded == "stale" and sheet(p, "a").is_stale


def test_a_member_that_missed_two_of_its_own_heartbeats_is_stale_before_the_threshold() -> None:
    beat = msgspec.structs.replace(hb("a"), heartbeat_interval_s=0.5)  # stale after 2 x 0.5 + 0.2 = 1.2 s
    assert stale_limit_s(beat, 3.0) == pytest.approx(1.2)
    assert stale_limit_s(hb("a"), 3.0) == 3.0  # no advertised interval: the threshold
    assert stale_limit_s(msgspec.structs.replace(beat, heartbeat_interval_s=5.0), 3.0) == 3.0  # never later
    fresh = member(hb("b", running=7))
    late = choose([member(beat, received_s=NOW - 1.3), fresh])
    assert late.member_id == "b" and sheet(late, "a").excluded == "stale"
    on_time = choose([member(beat, received_s=NOW - 1.1), fresh])
    assert on_time.member_id == "a" and sheet(on_time, "a").excluded is None


def test_when_every_heartbeat_is_stale_members_are_scored_by_in_flight_only() -> None:
    a = member(hb("a", running=0), received_s=NOW - 10, in_flight=3)
    b = member(hb("b", running=8), received_s=NOW - 10, in_flight=1)
    p = choose([a, b])
    assert p.member_id == "b" and p.reason == "in_flight_only"
    assert sheet(p, "a").load == pytest.approx(0.75 * 3 / 8) and sheet(p, "b").load == pytest.approx(0.75 * 1 / 8)


@pytest.mark.parametrize("state", ["down", "stopped", "draining"])
def test_down_stopped_and_draining_members_are_never_picked_even_when_alone(state: str) -> None:
    p = choose([member(hb("a", state=state))])
    assert p.member_id is None and p.reason == "no_live_member" and p.ranked == ()
    assert sheet(p, "a").excluded == state


def test_a_member_the_gateway_saw_failing_is_never_picked() -> None:
    p = choose([member(hb("a"), is_down=True), member(hb("b", running=8, waiting=8))])
    assert p.member_id == "b" and sheet(p, "a").excluded == "down"
    assert choose([member(hb("a"), is_down=True)]).member_id is None


def test_members_whose_context_is_too_short_are_filtered() -> None:
    small = member(hb("a"), max_context=4096)
    big = member(hb("b", running=6, max_context=32768))
    p = choose([small, big], RouteRequest(prompt_tokens=5000))
    assert p.member_id == "b" and sheet(p, "a").excluded == "context"
    p = choose([small], RouteRequest(prompt_tokens=5000))
    assert p.member_id is None and p.reason == "no_member_fits_context"


# --- §3 selection: overflow, capacity, ties -------------------------------------------------------------
def test_members_at_or_above_the_overflow_threshold_are_skipped() -> None:
    busy = member(hb("a", running=8, waiting=3))  # 0.75 + 0.15 * 3/4 = 0.8625 >= 0.85
    calm = member(hb("b", running=8, waiting=2))  # 0.75 + 0.15 * 2/4 = 0.825
    p = choose([busy, calm])
    assert sheet(p, "a").is_busy and not sheet(p, "b").is_busy
    assert p.member_id == "b" and p.ranked == ("b", "a")


def test_when_every_member_is_busy_the_least_loaded_wins_with_reason_overflow() -> None:
    a = member(hb("a", running=8, waiting=4))  # 0.75 + 0.15 * 1 = 0.9
    b = member(hb("b", running=8, waiting=3))  # 0.8625
    p = choose([a, b])
    assert p.member_id == "b" and p.reason == "overflow" and p.ranked == ("b", "a")


def test_the_backlog_term_tells_busy_members_apart_beyond_the_saturated_queue_score() -> None:
    a = member(hb("a", running=8, waiting=12))  # both score 0.9; a has 12 - 4 = 8 waiting beyond lanes/2
    b = member(hb("b", running=8, waiting=6))
    policy = PoolPolicy(capacity_bias=0.0, prefill_weight=0.0)
    p = choose([a, b], policy=policy)
    assert sheet(p, "a").backlog == pytest.approx(0.5 * (12 - 4) / 8)
    assert sheet(p, "b").backlog == pytest.approx(0.5 * (6 - 4) / 8)
    assert p.member_id == "b"


def test_unequal_weights_measure_lane_occupancy_against_each_members_share_of_the_free_lanes() -> None:
    small = member(hb("a", running=2), capacity=4)
    big = member(hb("b", running=3), capacity=16)
    p = choose([small, big], policy=PoolPolicy(capacity_bias=0.1, backlog_weight=0.0, prefill_weight=0.0))
    # 16 free-member lanes split 4:16 -> 3.2 and 12.8 fair lanes; no route history yet, so no capacity_term
    assert (sheet(p, "a").fair_lanes, sheet(p, "b").fair_lanes) == pytest.approx((3.2, 12.8))
    assert sheet(p, "a").cost == pytest.approx(0.75 * 2 / 3.2)
    assert sheet(p, "b").cost == pytest.approx(0.75 * 3 / 12.8)
    assert p.member_id == "b" and sheet(p, "b").capacity_term == 0.0
    # equal weights: each member's own lanes, as before
    p = choose([member(hb("a", running=2)), member(hb("b", running=3))], policy=PoolPolicy())
    assert sheet(p, "a").fair_lanes is None and sheet(p, "a").cost == pytest.approx(0.75 * 2 / 8)


def _route_counts(n: int, weights: dict[str, float], lanes: int, concurrency: int, duration: int,
                  policy: PoolPolicy = PoolPolicy()) -> Counter[str]:
    """n requests through pick(), each held for ``duration`` routing steps with at most ``concurrency`` open
    (1 = sequential); heartbeats show the open requests as running; route history kept as the gateway does."""
    from services.gateway.routing_adapter import PoolRoutes
    routes, served = PoolRoutes(), Counter[str]()
    open_: list[tuple[int, str]] = []  # (ends at step, member)
    for step in range(n):
        open_ = [(end, mid) for end, mid in open_ if end > step]
        while len(open_) >= concurrency:
            open_.pop(0)
        running = Counter(mid for _, mid in open_)
        members = [MemberState(member_id=w, engine_kind="ninfer", capacity_weight=cw,
                               heartbeat=hb(w, lanes=lanes, running=running[w]), received_s=100.0,
                               recent_routes=routes.recent.get(w, 0.0)) for w, cw in weights.items()]
        chosen = pick(policy, W, members, RouteRequest(), None, None, NOW, None).member_id
        assert chosen is not None
        routes.record(chosen, NOW)
        served[chosen] += 1
        open_.append((step + duration, chosen))
    return served


@pytest.mark.parametrize(("concurrency", "duration"), [(1, 1), (2, 2), (4, 4), (8, 8), (12, 24)])
def test_weights_3_to_1_split_400_requests_75_25_while_both_have_free_lanes(concurrency: int, duration: int) -> None:
    served = _route_counts(400, {"a": 3.0, "b": 1.0}, lanes=16, concurrency=concurrency, duration=duration)
    assert 0.70 <= served["a"] / 400 <= 0.80, served


def test_weights_8_to_1_hold_and_a_full_member_sends_the_rest_to_the_one_with_free_lanes() -> None:
    served = _route_counts(450, {"a": 8.0, "b": 1.0}, lanes=64, concurrency=8, duration=8)
    assert 8 / 9 - 0.05 <= served["a"] / 450 <= 8 / 9 + 0.05, served
    # 12 open on 8 + 8 lanes: the weight says 9:3, but a has only 8 lanes; b takes what a cannot
    served = _route_counts(400, {"a": 3.0, "b": 1.0}, lanes=8, concurrency=12, duration=12)
    assert 0.60 <= served["a"] / 400 <= 0.70, served


def test_capacity_bias_zero_leaves_only_the_lane_share_so_idle_members_tie_to_the_bigger() -> None:
    served = _route_counts(40, {"a": 3.0, "b": 1.0}, lanes=16, concurrency=1, duration=1,
                           policy=PoolPolicy(capacity_bias=0.0))
    assert served == {"a": 40}


def test_max_pool_share_sends_new_conversations_to_a_sibling_and_keeps_pinned_ones() -> None:
    members = [member(hb("a"), capacity=1), member(hb("b"), capacity=1)]
    members[0].routes_today, members[1].routes_today = 70, 30
    policy = PoolPolicy(capacity_bias=0.0, max_pool_share=0.6)
    p = choose([member(hb("a", running=0)), member(hb("b", running=2))], policy=policy)
    assert p.member_id == "a"  # no history: no cap
    loaded = [member(hb("a", running=0)), member(hb("b", running=2))]
    loaded[0].routes_today, loaded[1].routes_today = 70, 30
    p = choose(loaded, policy=policy)
    assert sheet(p, "a").over_pool_share and p.member_id == "b"  # a new talk goes to the sibling
    pins = PinTable()
    pins.pin("s1", "a", NOW)
    p = choose(loaded, RouteRequest(session_key="s1"), policy, pins=pins)
    assert p.member_id == "a" and not sheet(p, "a").over_pool_share  # an existing conversation keeps its GPU
    p = choose(loaded, policy=PoolPolicy(capacity_bias=0.0))
    assert p.member_id == "a"  # 0: off


def test_ties_go_to_the_larger_capacity_then_to_the_lower_member_id() -> None:
    assert choose([member(hb("a"), capacity=4), member(hb("b"), capacity=16)]).member_id == "b"
    assert choose([member(hb("z")), member(hb("y"))]).member_id == "y"


def test_pending_prefill_costs_at_the_affinity_exchange_rate() -> None:
    queued = member(hb("a"), pending_chars=8000)
    policy = PoolPolicy(capacity_bias=0.0, backlog_weight=0.0, prefill_weight=0.5, affinity_weight=0.6)
    p = choose([queued, member(hb("b", running=1))], policy=policy)
    assert sheet(p, "a").pending_prefill == pytest.approx(0.5 * 0.6 * 8000 / 8000)
    assert p.member_id == "b"  # 0.75 * 1/8 < 0.3


# --- no herding -----------------------------------------------------------------------------------------
def test_a_hundred_sequential_picks_with_bookings_spread_evenly_over_four_idle_members() -> None:
    routed = Counter[str]()
    for _ in range(100):  # no heartbeat refresh: every request stays unseen (admitted 0) and open
        members = [member(hb(w), routed=routed[w], admitted=0, in_flight=routed[w]) for w in "abcd"]
        routed[choose(members, policy=PoolPolicy()).member_id] += 1  # type: ignore[index]
    assert routed == {"a": 100 / 4, "b": 100 / 4, "c": 100 / 4, "d": 100 / 4}


def test_no_signal_members_are_spread_by_the_gateways_own_in_flight_even_with_affinity() -> None:
    table = AffinityTable()
    keys = prefix_hashes(conversation("s" * 8000, "hi"))
    table.record(keys, "a", NOW)
    routed = Counter[str]()
    for _ in range(40):
        members = [member(hb(w, kind="llamacpp", lanes=None, running=None), in_flight=routed[w], capacity=8)
                   for w in "abcd"]
        p = choose(members, RouteRequest(prefix_keys=keys), PoolPolicy(), affinity=table)
        routed[p.member_id] += 1  # type: ignore[index]
    # a holds the prefix (saving 0.6) and takes more, but each request costs 0.75/8 more there, without bound:
    # a leads the others by at most 0.6 / (0.75/8) = 6.4 requests
    assert routed["a"] - min(routed.values()) <= 0.6 / (0.75 / 8) + 1
    assert sum(routed.values()) == 40 and len(routed) == 4


# --- §4 cache affinity ----------------------------------------------------------------------------------
def test_prefix_keys_cover_every_depth_including_the_system_prompt_alone() -> None:
    one = prefix_hashes(conversation("S" * 100, "question one"))
    two = prefix_hashes(conversation("S" * 100, "question two"))
    assert [k.depth for k in one] == [1, 2]
    assert one[0] == two[0] and one[1] != two[1]  # tenants sharing only a system prompt share depth 1
    assert one[0].prefix_chars == 100 and one[1].prefix_chars == 100 + len("question one")


def test_prefix_keys_accept_chat_message_structs_and_content_parts() -> None:
    from proto import ChatMessage

    assert prefix_hashes([ChatMessage(role="user", content="hi")]) == prefix_hashes([{"role": "user", "content": "hi"}])
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert prefix_hashes(parts)[0].depth == 1 and prefix_hashes(parts) != prefix_hashes([{"role": "user",
                                                                                            "content": "hi"}])


def test_lookup_returns_the_deepest_live_entry_at_every_depth() -> None:
    table = AffinityTable()
    turn1 = conversation("S" * 1000, "u1")
    table.record(prefix_hashes(turn1), "a", NOW)
    # another tenant request with only the system prompt in common: depth 1
    assert table.lookup(prefix_hashes(conversation("S" * 1000, "other")), NOW) == ("a", 1, 1000)
    # the next turn of the same chat: the whole previous prompt (depth 2)
    turn2 = conversation("S" * 1000, "u1", "reply", "u2")
    assert table.lookup(prefix_hashes(turn2), NOW) == ("a", 2, 1000 + 2)
    assert table.lookup(prefix_hashes(conversation("T", "u1")), NOW) is None


def test_affinity_is_a_cost_a_long_cached_prefix_beats_a_slightly_less_loaded_member() -> None:
    table = AffinityTable()
    long_keys = prefix_hashes(conversation("S" * 8000, "q"))
    table.record(long_keys, "a", NOW)
    cached = member(hb("a", running=3))  # 0.75 * 3/8 - 0.6 * min(8001/8000, 1)
    other = member(hb("b", running=2))  # 0.75 * 2/8
    p = choose([cached, other], RouteRequest(prefix_keys=long_keys), PoolPolicy(capacity_bias=0.0), affinity=table)
    assert sheet(p, "a").affinity_saving == pytest.approx(0.6 * 1)
    assert sheet(p, "a").cost == pytest.approx(0.75 * 3 / 8 - 0.6)
    assert p.member_id == "a" and p.reason == "affinity"


def test_affinity_credit_is_in_the_members_tokens_and_its_cache_bound_at_its_measured_characters_per_token(
        ) -> None:
    # issue #29: text at ~5.7 characters per token; a fixed 4 undervalued a prefix and underestimated the cache
    table = AffinityTable()
    keys = prefix_hashes(conversation("S" * 6000, "q"))
    table.record(keys, "a", NOW)
    at4 = choose([member(hb("a")), member(hb("b"))], RouteRequest(prefix_keys=keys), PLAIN, affinity=table)
    assert sheet(at4, "a").affinity_saving == pytest.approx(0.6 * 6001 / 8000)
    dense = member(hb("a"))
    dense.chars_per_token = 3.0  # 6001 characters are 2,000 tokens of prefill saved: the full credit
    p = choose([dense, member(hb("b"))], RouteRequest(prefix_keys=keys), PLAIN, affinity=table)
    assert sheet(p, "a").affinity_saving == pytest.approx(0.6)
    cache = SlotHeartbeat(worker_id="a", session_id="s", seq=1, ts_s=0.0, model_id="m", kv_capacity_tokens=1000)
    assert cache_capacity_chars(cache) == 4000 and cache_capacity_chars(cache, 5.7) == 5700


def test_the_fleet_learns_a_members_characters_per_token_from_its_counts() -> None:
    fleet = Fleet("gw")
    fleet.note_prompt("a", 100, 10)  # too short to teach anything (the template's tokens dominate)
    assert fleet.record("a").chars_per_token is None
    fleet.note_prompt("a", 5700, 1000)
    assert fleet.record("a").chars_per_token == pytest.approx(5.7)
    for _ in range(60):
        fleet.note_prompt("a", 3000, 1000)
    assert fleet.record("a").chars_per_token == pytest.approx(3.0, abs=0.01)
    fleet.note_prompt("c", 10**9, 40)  # a garbled count is clamped
    assert fleet.record("c").chars_per_token == 12.0
    fleet.note_prompt("b", 5000, None)  # the member never said
    assert fleet.record("b").chars_per_token is None


def test_affinity_is_a_cost_a_short_cached_prefix_does_not_beat_a_less_loaded_member() -> None:
    table = AffinityTable()
    short_keys = prefix_hashes(conversation("S" * 400, "q"))
    table.record(short_keys, "a", NOW)
    p = choose([member(hb("a", running=3)), member(hb("b", running=2))], RouteRequest(prefix_keys=short_keys),
               PoolPolicy(capacity_bias=0.0), affinity=table)
    assert sheet(p, "a").affinity_saving == pytest.approx(0.6 * 401 / 8000)  # 0.03 < 0.75 / 8
    assert p.member_id == "b" and p.reason == "least_loaded"


def test_affinity_is_ignored_at_or_above_the_busy_guard() -> None:
    table = AffinityTable()
    keys = prefix_hashes(conversation("S" * 8000, "q"))
    table.record(keys, "a", NOW)
    hot = member(hb("a", running=8, waiting=4, kv=0.95))  # 0.75 + 0.15 + 0.10 * 0.95 = 0.995 >= 0.95
    p = choose([hot, member(hb("b", running=8, waiting=4))], RouteRequest(prefix_keys=keys), PoolPolicy(),
               affinity=table)
    assert sheet(p, "a").affinity_guarded and sheet(p, "a").affinity_saving == 0.0
    assert p.member_id == "b"


def test_cache_affinity_off_ignores_the_table() -> None:
    table = AffinityTable()
    keys = prefix_hashes(conversation("S" * 8000, "q"))
    table.record(keys, "a", NOW)
    p = choose([member(hb("a", running=1)), member(hb("b"))], RouteRequest(prefix_keys=keys),
               PoolPolicy(cache_affinity=False, capacity_bias=0.0), affinity=table)
    assert p.member_id == "b" and sheet(p, "a").affinity_depth == 0


def test_the_affinity_table_evicts_the_least_recently_recorded_key() -> None:
    table = AffinityTable(max_entries=2, ttl_s=60)
    k1, k2, k3 = (prefix_hashes([{"role": "system", "content": c}]) for c in ("one", "two", "three"))
    table.record(k1, "a", 0.0)
    table.record(k2, "a", 1.0)
    table.record(k1, "b", 2.0)  # k1 is now the most recent
    table.record(k3, "a", 3.0)  # evicts k2
    assert len(table) == 2
    assert table.lookup(k2, 3.0) is None and table.lookup(k1, 3.0) == ("b", 1, 3)


def test_affinity_entries_expire_after_the_ttl() -> None:
    table = AffinityTable(ttl_s=60)
    keys = prefix_hashes(conversation("S", "q"))
    table.record(keys, "a", 0.0)
    assert table.lookup(keys, 60.0) is not None and table.lookup(keys, 60.1) is None
    assert table.lookup_members(keys, 60.1) == {}


def test_the_affinity_table_survives_a_restart_with_entries_keeping_their_age() -> None:
    table = AffinityTable(ttl_s=100)
    old, new = prefix_hashes(conversation("old")), prefix_hashes(conversation("new"))
    table.record(old, "a", 0.0)
    table.record(new, "b", 50.0)
    text = table.to_json(now_s=60.0)
    assert json.loads(text)["schema"] == 1
    # 30 s of downtime: "old" is 60 + 30 = 90 s old (live), "new" 10 + 30 = 40 s
    restored = AffinityTable.from_json(text, now_s=90.0, ttl_s=100)
    assert restored.lookup(old, 90.0) == ("a", 1, 3) and restored.lookup(new, 90.0) == ("b", 1, 3)
    assert restored.lookup(old, 100.1) is None  # 100.1 s old
    # loaded 50 s after saving: "old" is 110 s old and dropped on load
    assert len(AffinityTable.from_json(text, now_s=110.0, ttl_s=100)) == 1
    with pytest.raises(ValueError):
        AffinityTable.from_json('{"schema": 99}', now_s=0.0)
    # a file from before own-chars were saved: each row counts its whole prefix
    data = json.loads(text)
    data["entries"] = [row[:4] for row in data["entries"]]
    older = AffinityTable.from_json(json.dumps(data), now_s=90.0, ttl_s=100)
    assert older.lookup(old, 90.0) == ("a", 1, 3) and older.held_chars("a") == 3


def _credited(table: AffinityTable) -> dict[str, int]:
    """Each member's credited chars, summed from the persisted entries (own chars x membership)."""
    out: Counter[str] = Counter()
    for _digest, _depth, _chars, members, own in json.loads(table.to_json(0.0))["entries"]:
        for m, _age in members:
            out[m] += own
    return dict(out)


def test_a_members_credit_is_bounded_by_its_cache_size_and_forgets_its_least_recent_prefixes() -> None:
    table = AffinityTable(ttl_s=600)
    a = prefix_hashes(conversation("A" * 60, "q" * 10))  # own chars 60, 10
    b = prefix_hashes(conversation("B" * 60, "r" * 10))
    table.record(a, "e1", 0.0, capacity_chars=100)
    table.record(a, "e2", 0.0, capacity_chars=100)
    table.record(b, "e1", 1.0, capacity_chars=100)  # 140 > 100: e1 forgets a (e2 still holds it)
    assert table.held_chars("e1") == 70 and set(table.lookup_members(a, 2.0)) == {"e2"}
    assert table.lookup_members(b, 2.0)["e1"].depth == 2
    # within one request the tail goes first: b's turn (10) before its system prompt (60)
    table.record(a, "e1", 3.0, capacity_chars=140)
    table.record(prefix_hashes(conversation("C" * 5)), "e1", 4.0, capacity_chars=140)  # 145: b's turn goes
    assert table.lookup_members(b, 5.0)["e1"].depth == 1 and table.held_chars("e1") == 135
    assert _credited(table) == {"e1": 135, "e2": 70}


def test_a_request_larger_than_the_cache_keeps_its_head_and_no_capacity_keeps_everything() -> None:
    table = AffinityTable(ttl_s=600)
    keys = prefix_hashes(conversation("S" * 300, "q" * 50))
    table.record(keys, "e1", 0.0, capacity_chars=200)
    assert table.lookup_members(keys, 1.0)["e1"].depth == 1 and table.held_chars("e1") == 300
    for i in range(50):
        table.record(prefix_hashes(conversation(f"{i:02d}" + "x" * 98)), "e2", float(i))
    assert table.held_chars("e2") == 50 * 100
    assert "e2" in table.lookup_members(prefix_hashes(conversation("00" + "x" * 98)), 60.0)


def test_record_route_bounds_the_credit_by_the_cache_size_the_heartbeat_states() -> None:
    beat = SlotHeartbeat(worker_id="a", session_id="s", seq=1, ts_s=0.0, model_id="m", kv_capacity_tokens=25)
    assert cache_capacity_chars(beat) == 100  # 4 characters per token
    assert cache_capacity_chars(hb("a")) is None and cache_capacity_chars(None) is None
    table = AffinityTable()
    first, second = (RouteRequest(prefix_keys=prefix_hashes(conversation(c * 80))) for c in "xy")
    for request in (first, second):
        record_route(PoolPolicy(), request, choose([member(hb("a"))], request), "a", table, None, NOW,
                     cache_capacity_chars(beat))
    assert table.lookup_members(first.prefix_keys, NOW) == {} and "a" in table.lookup_members(second.prefix_keys, NOW)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 4), st.sampled_from(["a", "b", "c"]),
                          st.sampled_from([None, 150, 400])), max_size=40))
def test_credited_chars_stay_consistent_through_every_kind_of_forgetting(
        ops: list[tuple[int, int, str, int | None]]) -> None:
    """Capacity, members-per-key and the table's own LRU all forget; held_chars always equals the entries."""
    table = AffinityTable(max_entries=12, ttl_s=600, max_members_per_key=2)
    for t, (conv, turns, mid, capacity) in enumerate(ops):
        contents = [f"sys{conv}" + "s" * 40] + [f"{conv}-{k}" + "t" * 20 for k in range(turns)]
        table.record(prefix_hashes(conversation(*contents)), mid, float(t), capacity_chars=capacity)
        credited = _credited(table)
        assert {m: table.held_chars(m) for m in "abc" if table.held_chars(m)} == credited
    restored = AffinityTable.from_json(table.to_json(float(len(ops))), float(len(ops)), max_entries=12, ttl_s=600,
                                       max_members_per_key=2)
    assert {m: restored.held_chars(m) for m in "abc"} == {m: table.held_chars(m) for m in "abc"}
    # and in the same order: the next forgetting forgets the same prefixes
    for t_ in (table, restored):
        t_.record(prefix_hashes(conversation("new" + "n" * 60)), "a", float(len(ops) + 1), capacity_chars=150)
    assert _credited(restored) == _credited(table)


# --- §5 session pinning ---------------------------------------------------------------------------------
def test_a_pinned_session_goes_to_its_member_while_it_is_not_busy() -> None:
    pins = PinTable()
    pins.pin("sess", "a", NOW)
    p = choose([member(hb("a", running=2)), member(hb("b", running=1))], RouteRequest(session_key="sess"),
               pins=pins)
    assert sheet(p, "a").pin == pytest.approx(0.2)
    assert sheet(p, "a").cost == pytest.approx(0.75 * 2 / 8 - 0.2)
    assert p.member_id == "a" and p.reason == "pinned" and p.pinned_member == "a"


def test_a_pin_to_a_busy_member_is_broken_and_moves_to_the_new_pick() -> None:
    pins = PinTable()
    pins.pin("sess", "a", NOW)
    request = RouteRequest(session_key="sess")
    p = choose([member(hb("a", running=8, waiting=4)), member(hb("b", running=7))], request, pins=pins)
    assert p.member_id == "b" and p.reason == "pin_broken_busy" and p.pin_broken == "busy"
    record_route(PLAIN, request, p, "b", None, pins, NOW)
    assert pins.get("sess", NOW) == "b"


def test_a_pin_to_a_down_or_missing_member_is_broken_and_moves_to_the_new_pick() -> None:
    pins = PinTable()
    request = RouteRequest(session_key="sess")
    for gone in ([member(hb("a"), is_down=True), member(hb("b"))], [member(hb("b"))]):
        pins.pin("sess", "a", NOW)
        p = choose(gone, request, pins=pins)
        assert p.member_id == "b" and p.reason == "pin_broken_down"
        record_route(PLAIN, request, p, "b", None, pins, NOW)
        assert pins.get("sess", NOW) == "b"


def test_an_honoured_pin_stays_when_a_much_cheaper_member_wins_and_moves_on_failover() -> None:
    pins = PinTable()
    pins.pin("sess", "a", NOW)
    request = RouteRequest(session_key="sess")
    p = choose([member(hb("a", running=6)), member(hb("b"))], request, pins=pins)
    assert p.member_id == "b" and p.pin_broken is None  # 0.75 * 6/8 - 0.2 > 0
    record_route(PLAIN, request, p, "b", None, pins, NOW)
    assert pins.get("sess", NOW) == "a"  # broken only by busy or down
    p = choose([member(hb("a")), member(hb("b"))], request, pins=pins)
    record_route(PLAIN, request, p, "b", None, pins, NOW)  # a failed before the first byte; b served
    assert pins.get("sess", NOW) == "b"


def test_an_api_key_pin_weighs_api_key_sticky_times_the_sticky_bias() -> None:
    pins = PinTable()
    pins.pin("key-1", "a", NOW)
    request = RouteRequest(session_key="key-1", is_session_header=False)
    members = [member(hb("a", running=1)), member(hb("b"))]
    assert sheet(choose(members, request, PoolPolicy(api_key_sticky=0.0), pins=pins), "a").pin == 0.0
    assert sheet(choose(members, request, PoolPolicy(api_key_sticky=0.5), pins=pins), "a").pin == pytest.approx(
        0.2 * 0.5)


def test_the_pin_table_evicts_lru_and_expires_after_the_ttl() -> None:
    pins = PinTable(max_entries=2, ttl_s=10)
    pins.pin("s1", "a", 0.0)
    pins.pin("s2", "a", 1.0)
    pins.pin("s1", "b", 2.0)
    pins.pin("s3", "c", 3.0)  # evicts s2
    assert pins.get("s2", 3.0) is None and pins.get("s1", 3.0) == "b"
    assert pins.get("s3", 13.0) == "c" and pins.get("s3", 13.1) is None
    restored = PinTable.from_json(pins.to_json(5.0), now_s=6.0, ttl_s=10)
    assert restored.get("s1", 6.0) == "b" and restored.get("s1", 12.1) is None


# --- the explanation and the table contract ---------------------------------------------------------------
def test_the_pick_explains_every_candidate_and_ranks_the_failover_order() -> None:
    table = AffinityTable()
    keys = prefix_hashes(conversation("S" * 4000, "q"))
    table.record(keys, "b", NOW)
    members = [member(hb("a", running=1)), member(hb("b", running=2), routed=3, admitted=2, in_flight=1),
               member(hb("c", running=8, waiting=4)), member(hb("d", state="draining"))]
    policy = PoolPolicy(overflow_threshold=0.85, capacity_bias=0.0, prefill_weight=0.0)
    p = choose(members, RouteRequest(prefix_keys=keys), policy, affinity=table)
    b = sheet(p, "b")
    assert (b.booked, b.affinity_depth, b.affinity_chars) == (1, 2, 4000 + 1)
    assert b.load == pytest.approx(0.75 * (2 + 1) / 8)
    assert b.affinity_saving == pytest.approx(0.6 * 4001 / 8000)
    assert b.cost == pytest.approx(0.75 * 3 / 8 - 0.6 * 4001 / 8000)
    assert sheet(p, "c").is_busy and sheet(p, "d").excluded == "draining" and sheet(p, "d").cost is None
    assert p.member_id == "b" and p.reason == "affinity" and p.ranked == ("b", "a", "c")
    assert [c.member_id for c in p.candidates] == ["a", "b", "c", "d"]


def test_pick_reads_the_tables_and_never_writes_them() -> None:
    table, pins = AffinityTable(), PinTable()
    keys = prefix_hashes(conversation("S", "q"))
    table.record(keys, "a", 0.0)
    pins.pin("sess", "a", 0.0)
    before = (table.to_json(NOW), pins.to_json(NOW))
    choose([member(hb("a")), member(hb("b"))], RouteRequest("sess", True, keys), affinity=table, pins=pins)
    assert (table.to_json(NOW), pins.to_json(NOW)) == before


def test_a_single_eligible_member_is_picked_with_reason_only_member() -> None:
    p = choose([member(hb("a", running=8, waiting=8)), member(hb("b", state="stopped"))])
    assert p.member_id == "a" and p.reason == "only_member" and p.ranked == ("a",)


def test_pool_policy_rejects_out_of_range_knobs_naming_them() -> None:
    with pytest.raises(ValueError, match="overflow_threshold"):
        PoolPolicy(overflow_threshold=1.5)
    with pytest.raises(ValueError, match="affinity_full_chars"):
        PoolPolicy(affinity_full_chars=0)


# --- property: any member set ---------------------------------------------------------------------------
_member = st.builds(
    lambda i, kind, lanes, running, waiting, state, age, in_flight, down, cap, has_hb: member(
        hb(f"m{i}", kind=kind, lanes=lanes, running=running, waiting=waiting, state=state) if has_hb else None,
        f"m{i}", received_s=NOW - age, in_flight=in_flight, routed=in_flight, admitted=0, is_down=down,
        capacity=cap),
    st.integers(0, 1000), st.sampled_from(["native", "ninfer", "vllm", "llamacpp", "sglang", "stock"]),
    st.one_of(st.none(), st.integers(1, 64)), st.one_of(st.none(), st.integers(0, 80)), st.integers(0, 80),
    st.sampled_from(["ready", "ready", "draining", "stopped", "down"]), st.floats(0, 10), st.integers(0, 100),
    st.booleans(), st.floats(0.5, 64), st.booleans(),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_member, max_size=8, unique_by=lambda m: m.member_id), st.booleans())
def test_any_member_set_yields_a_live_member_or_none_and_ranks_exactly_the_eligible(members, with_pin) -> None:
    pins = PinTable()
    if with_pin and members:
        pins.pin("s", members[0].member_id, NOW)
    p = choose(members, RouteRequest(session_key="s"), PoolPolicy(), pins=pins)
    eligible = {c.member_id for c in p.candidates if c.excluded is None}
    assert sorted(p.ranked) == sorted(eligible)
    if p.member_id is None:
        assert not eligible
    else:
        assert p.member_id == p.ranked[0]
        chosen = next(m for m in members if m.member_id == p.member_id)
        assert not chosen.is_down
        assert chosen.heartbeat is None or chosen.heartbeat.state == "ready"


def test_the_gateway_bounds_affinity_by_the_capacity_in_the_members_last_heartbeat() -> None:
    from services.gateway import routing_adapter
    from services.gateway.fleet import Fleet

    router, fleet = routing_adapter.Router(None, NOW), Fleet("gw")
    fleet.observe(SlotHeartbeat(worker_id="w1", session_id="s", seq=1, ts_s=NOW, model_id="m",
                                kv_capacity_tokens=25), NOW)  # 100 characters
    for content in ("x" * 80, "y" * 80):
        request = RouteRequest(prefix_keys=prefix_hashes(conversation(content)))
        p = choose([member(fleet.record("w1").heartbeat, "w1")], request, affinity=router.affinity)
        router.record_success(routing_adapter.Decision(p, request, PoolPolicy()), "w1", fleet, NOW)
    assert router.affinity.held_chars("w1") == 80  # the first prompt was forgotten for w1
    # a member whose heartbeat states no capacity (or that sends none) is credited with everything it served
    for content in ("x" * 80, "y" * 80):
        request = RouteRequest(prefix_keys=prefix_hashes(conversation(content)))
        p = choose([member(None, "w2")], request, affinity=router.affinity)
        router.record_success(routing_adapter.Decision(p, request, PoolPolicy()), "w2", fleet, NOW)
    assert router.affinity.held_chars("w2") == 160
