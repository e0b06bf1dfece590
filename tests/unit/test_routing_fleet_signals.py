"""Issue #29 items 5-6, many gateways and the energy tie-break (docs/routing.md §2, §3, §6), arithmetic written out.

Each test fails on the router before these changes: vLLM-shaped members booked every open request on top of
``running``; the affinity credit saturated at 2,000 tokens; a hit outweighed any wait; J/token was not read;
replicas knew nothing of each other's routes.
"""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from proto import EnergyReading, EnergySample, RequestTokens, RouteNote, RouteNotes, SlotHeartbeat
from services.common.heartbeat_load import VLLM_KV_WEIGHT, VLLM_RUNNING_WEIGHT
from services.gateway.fleet import Fleet
from services.gateway.routing import (
    AffinityTable,
    MemberState,
    PinTable,
    PoolPolicy,
    RouteRequest,
    RoutingWeights,
    affinity_saving,
    pick,
    prefix_hashes,
    record_peer_route,
    unseen_bookings,
)

W = RoutingWeights()
NOW = 100.5
PLAIN = PoolPolicy(overflow_threshold=0.95, capacity_bias=0.0, backlog_weight=0.0, prefill_weight=0.0,
                   energy_margin=0.0)


def hb(wid: str, *, kind: str = "native", running: int = 0, waiting: int = 0, ts_s: float = 100.0, seq: int = 1,
       lanes: int = 8, kv: float = 0.0, prefill_tok_per_s: float | None = None) -> SlotHeartbeat:
    return SlotHeartbeat(worker_id=wid, session_id="s", seq=seq, ts_s=ts_s, model_id="m", engine_kind=kind,  # type: ignore[arg-type]
                         lanes=lanes, running=running, waiting=waiting, kv_usage=kv,
                         prefill_tok_per_s=prefill_tok_per_s)


def member(h: SlotHeartbeat, **kw: object) -> MemberState:
    base = MemberState(member_id=h.worker_id, engine_kind=h.engine_kind, heartbeat=h, received_s=100.0, admitted=0)
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def sheet(p, mid: str):
    return next(c for c in p.candidates if c.member_id == mid)


# --- item 5: members that do not count our requests --------------------------------------------------------
def test_a_vllm_member_books_only_what_was_routed_after_its_heartbeat_was_taken() -> None:
    fleet = Fleet("gw")
    for t in (99.0, 99.5, 100.2):  # three of ours open; the heartbeat taken at 100.0 holds the first two
        fleet.book("v", t)
    fleet.observe(hb("v", kind="vllm", running=2, ts_s=100.0), now_s=100.1)
    assert fleet.admitted("v") is None
    assert fleet.unseen("v") == 1
    rec = fleet.record("v")
    m = member(rec.heartbeat, admitted=None, in_flight=rec.in_flight, routed_since_heartbeat=fleet.unseen("v"))
    assert unseen_bookings(m) == 1
    # load: (running 2 + 1 booked) of 8 lanes, vLLM's weights; before, all 3 open requests were added to running 2
    p = pick(PLAIN, W, [m], RouteRequest(), None, None, NOW)
    assert sheet(p, "v").load == pytest.approx(VLLM_RUNNING_WEIGHT * 3 / 8 + VLLM_KV_WEIGHT * 0.0)


def test_a_refused_request_is_no_longer_booked_on_a_vllm_member() -> None:
    fleet = Fleet("gw")
    fleet.observe(hb("v", kind="vllm", ts_s=100.0), now_s=100.0)
    fleet.book("v", 100.3)
    fleet.unbook("v")
    assert fleet.unseen("v") == 0


def test_a_native_member_is_still_booked_by_its_admitted_count() -> None:
    fleet = Fleet("gw")
    fleet.observe(hb("n"), now_s=100.0)
    fleet.book("n", 100.3)
    assert fleet.unseen("n") is None  # its heartbeat's admitted_by_gateway decides (routing.unseen_bookings)


# --- item 5: content affinity relative to the prompt ------------------------------------------------------
def test_a_long_conversations_own_engine_is_clearly_cheaper_than_one_holding_only_its_system_prompt() -> None:
    # system prompt 8,000 chars, conversation 24,000 chars so far + a 400-char turn: at 4 chars per token the
    # credit cap (2,000 tokens = 8,000 chars) gave both holders the full 0.6
    system, history, turn = "s" * 8000, "h" * 24000, "u" * 400
    keys = prefix_hashes([{"role": "system", "content": system}, {"role": "user", "content": history},
                          {"role": "assistant", "content": "a"}, {"role": "user", "content": turn}])
    affinity = AffinityTable()
    affinity.record(keys[:3], "own", 99.0)
    affinity.record(keys[:1], "sys", 99.5)
    members = [member(hb("own")), member(hb("sys"))]
    p = pick(PLAIN, W, members, RouteRequest(prefix_keys=keys), affinity, None, NOW)
    prompt_tokens = (8000 + 24000 + 1 + 400) / 4
    assert sheet(p, "own").affinity_saving == pytest.approx(0.6 * (32001 / 4) / prompt_tokens)
    assert sheet(p, "sys").affinity_saving == pytest.approx(0.6 * (8000 / 4) / prompt_tokens)
    assert sheet(p, "own").affinity_saving - sheet(p, "sys").affinity_saving > 0.4
    assert p.member_id == "own"


@pytest.mark.parametrize(("matched", "prompt", "expected"), [
    (4000, 6000, 0.6 * 1000 / 2000),  # a prompt within 2,000 tokens: the old min(matched / full, 1)
    (8000, 8000, 0.6 * 1.0),
    (8000, 8400, 0.6 * 2000 / 2100),
    (8000, 16000, 0.6 * 2000 / 4000),  # past it: the share of the prompt held
    (15600, 16000, 0.6 * 3900 / 4000),
])
def test_affinity_saving_parity_table(matched: int, prompt: int, expected: float) -> None:
    assert affinity_saving(PoolPolicy(), member(hb("a")), matched, prompt) == pytest.approx(expected)


# --- item 6: the wait accepted for a hit is bounded by the prefill it saves --------------------------------
def test_a_hit_behind_a_queue_is_credited_only_the_share_of_the_wait_its_prefill_saving_covers() -> None:
    keys = prefix_hashes([{"role": "system", "content": "s" * 8000}, {"role": "user", "content": "u" * 400}])
    affinity = AffinityTable()
    affinity.record(keys, "holder", 99.0)
    # holder: 8 lanes all busy, 1 waiting -> 2 requests must finish first; a lane frees every 4.0 / 8 s: wait 1.0 s.
    # the hit saves 2,100 tokens at 10,500 tok/s = 0.2 s; another member has a free lane (wait 0).
    holder = member(hb("holder", running=8, waiting=1, prefill_tok_per_s=10500.0), mean_service_s=4.0)
    idle = member(hb("idle", running=3, prefill_tok_per_s=10500.0), mean_service_s=4.0)
    p = pick(PoolPolicy(overflow_threshold=0.99, affinity_busy_guard=0.99, capacity_bias=0.0, backlog_weight=0.0,
                        prefill_weight=0.0, energy_margin=0.0), W, [holder, idle], RouteRequest(prefix_keys=keys),
             affinity, None, NOW)
    s = sheet(p, "holder")
    assert s.wait_s == pytest.approx(2 * 4.0 / 8)
    assert s.saved_s == pytest.approx(8400 / 4 / 10500)
    assert s.affinity_saving == pytest.approx(0.6 * 1.0 * (0.2 / 1.0))
    # holder 0.75 + 0.15 * 1/4 = 0.7875 - 0.12 against idle 0.75 * 3/8 = 0.28125; the unbounded credit made the
    # queued holder win (0.7875 - 0.6 = 0.1875)
    assert p.member_id == "idle"


def test_with_every_member_queued_the_hit_keeps_its_full_credit() -> None:
    keys = prefix_hashes([{"role": "system", "content": "s" * 8000}, {"role": "user", "content": "u" * 400}])
    affinity = AffinityTable()
    affinity.record(keys, "holder", 99.0)
    holder = member(hb("holder", running=8, waiting=1, prefill_tok_per_s=10500.0), mean_service_s=4.0)
    other = member(hb("other", running=8, waiting=1, prefill_tok_per_s=10500.0), mean_service_s=4.0)
    p = pick(PoolPolicy(overflow_threshold=0.99, affinity_busy_guard=0.99, capacity_bias=0.0, backlog_weight=0.0,
                        prefill_weight=0.0, energy_margin=0.0), W, [holder, other], RouteRequest(prefix_keys=keys),
             affinity, None, NOW)
    assert sheet(p, "holder").affinity_saving == pytest.approx(0.6)
    assert p.member_id == "holder"


def test_fleet_measures_mean_service_time_from_finished_requests_only() -> None:
    fleet = Fleet("gw")
    fleet.book("a", 1.0)
    fleet.release("a", 2.0)
    fleet.book("a", 1.0)
    fleet.release("a", None)  # cut short: teaches nothing
    fleet.book("a", 1.0)
    fleet.release("a", 4.0)
    assert fleet.record("a").mean_service_s == pytest.approx(0.95 * 2.0 + 0.05 * 4.0)


# --- energy tie-break -------------------------------------------------------------------------------------
def _sample(seq: int, ts: float, mj: int, tokens: int, session: str = "s") -> EnergySample:
    return EnergySample(worker_id="g", session_id=session, seq=seq, ts_s=ts, model_id="m",
                        readings=[EnergyReading(device_id="gpu0", kind="nvml", method="counter", energy_mj=mj)],
                        request_tokens=[RequestTokens(request_id="r", output_tokens=tokens)])


def test_fleet_learns_joules_per_output_token_from_consecutive_energy_samples() -> None:
    fleet = Fleet("gw")
    fleet.note_energy(_sample(1, 10.0, 1_000_000, 50))  # the first sample only marks the counter
    assert fleet.record("g").joules_per_output_token is None
    fleet.note_energy(_sample(2, 11.0, 1_300_000, 100))  # 300 J over 100 tokens
    assert fleet.record("g").joules_per_output_token == pytest.approx(3.0)
    fleet.note_energy(_sample(3, 12.0, 1_400_000, 0))  # idle interval: not a J/token figure
    fleet.note_energy(_sample(4, 13.0, 1_000, 10))  # counter went down (reset): flagged, not guessed
    fleet.note_energy(_sample(1, 14.0, 2_000, 10, session="t"))  # a restart: a new mark
    assert fleet.record("g").joules_per_output_token == pytest.approx(3.0)
    fleet.note_energy(_sample(2, 15.0, 202_000, 100, session="t"))  # 200 J / 100 tokens = 2.0
    assert fleet.record("g").joules_per_output_token == pytest.approx(0.8 * 3.0 + 0.2 * 2.0)


def test_joules_per_step_takes_out_the_batch_size_the_heartbeats_saw() -> None:
    """Two members on equal hardware, one at batch 8 and one at batch 1: J/output-token differs ~8x (the
    batch), J per step (J/token x mean running) is the same; a member at 2/3 the power shows 2/3 of it."""
    def run(wid: str, running: int, joules_per_step: float) -> float | None:
        fleet = Fleet("gw")
        fleet.observe(hb(wid, running=running, ts_s=10.0), now_s=10.0)
        steps = 100  # one second: 100 steps of `running` sequences
        sample = _sample(1, 10.0, 0, 0)
        fleet.note_energy(msgspec.structs.replace(sample, worker_id=wid))
        fleet.observe(hb(wid, running=running, ts_s=10.5, seq=2), now_s=10.5)
        mj = int(steps * joules_per_step * 1000)
        fleet.note_energy(msgspec.structs.replace(_sample(2, 11.0, mj, steps * running), worker_id=wid))
        return fleet.record(wid).joules_per_step
    assert run("big-batch", 8, 3.0) == pytest.approx(3.0)
    assert run("one", 1, 3.0) == pytest.approx(3.0)
    assert run("greener", 8, 2.0) == pytest.approx(2.0)
    idle = Fleet("gw")  # no heartbeat said anything ran: J/token is learnt, J per step is not guessed
    idle.note_energy(_sample(1, 10.0, 0, 0))
    idle.note_energy(_sample(2, 11.0, 300_000, 100))
    assert idle.record("g").joules_per_output_token == pytest.approx(3.0) and idle.record("g").joules_per_step is None


def test_among_members_within_the_margin_the_more_efficient_one_wins() -> None:
    a = member(hb("a", running=1), joules_per_step=3.0)
    b = member(hb("b", running=1), joules_per_step=2.0, in_flight=1)  # later in the old order
    policy = dataclasses.replace(PLAIN, energy_margin=0.05)
    p = pick(policy, W, [a, b], RouteRequest(), None, None, NOW)
    assert (sheet(p, "a").cost, sheet(p, "b").cost) == (pytest.approx(0.75 / 8), pytest.approx(0.75 / 8))
    assert p.member_id == "b" and p.energy_over == "a"
    assert pick(PLAIN, W, [a, b], RouteRequest(), None, None, NOW).member_id == "a"  # margin 0: off


def test_energy_never_outweighs_more_than_the_margin_nor_a_small_difference() -> None:
    policy = dataclasses.replace(PLAIN, energy_margin=0.05)
    idle = member(hb("idle"), joules_per_step=3.0)
    busier = member(hb("busier", running=1), joules_per_step=1.0)  # 0.094 more: beyond the margin
    assert pick(policy, W, [idle, busier], RouteRequest(), None, None, NOW).member_id == "idle"
    # within 10 % (2.8 vs 3.0 J per step): measurement noise on equal hardware, not a reason to move
    # ("z" sorts after "idle")
    close = member(hb("z"), joules_per_step=2.8)
    p = pick(policy, W, [idle, close], RouteRequest(), None, None, NOW)
    assert p.member_id == "idle" and p.energy_over is None


def test_the_tie_break_does_not_pile_onto_a_loaded_member() -> None:
    policy = dataclasses.replace(PLAIN, energy_margin=0.5)
    a = member(hb("a", running=1), joules_per_step=3.0)
    loaded = member(hb("b", running=7), joules_per_step=1.0)  # within the margin, but its load is past 0.5
    assert pick(policy, W, [a, loaded], RouteRequest(), None, None, NOW).member_id == "a"
    greener = member(hb("b", running=1), joules_per_step=1.0, in_flight=1)
    assert pick(policy, W, [a, greener], RouteRequest(), None, None, NOW).member_id == "b"


def test_the_tie_break_never_wakes_an_idle_member_to_take_a_request_from_a_running_one() -> None:
    """An idle member pays a whole decode step per token (10 ms of the simulator's 10 + 0.6 ms/sequence step), a
    running one only the step's growth with one more sequence: at 2/3 the power, the idle member still costs more."""
    policy = dataclasses.replace(PLAIN, energy_margin=0.1)
    running = member(hb("a", running=1), joules_per_step=3.0)  # load 0.75 * 1/8 = 0.09375
    idle = member(hb("b", kv=0.95), joules_per_step=2.0)  # load 0.10 * 0.95 (KV past 0.9) = 0.095: within 0.1
    p = pick(policy, W, [running, idle], RouteRequest(), None, None, NOW)
    assert (sheet(p, "a").cost, sheet(p, "b").cost) == (pytest.approx(0.09375), pytest.approx(0.095))
    assert (sheet(p, "a").active, sheet(p, "b").active) == (1, 0)
    assert p.member_id == "a" and p.energy_over is None  # the old rule moved it to the idle "b"
    busy_too = member(hb("b", running=1, kv=0.95), joules_per_step=2.0)  # running: 0.09375 + 0.095, within 0.1
    p = pick(policy, W, [running, busy_too], RouteRequest(), None, None, NOW)
    assert p.member_id == "b" and p.energy_over == "a"
    idle_too = member(hb("a"), joules_per_step=3.0)  # both idle: nothing to join, the cheapest stays
    assert pick(policy, W, [idle_too, idle], RouteRequest(), None, None, NOW).member_id == "a"


def test_the_tie_break_keeps_a_pinned_session_and_moves_nothing_onto_a_queue_or_queued_prefill() -> None:
    policy = dataclasses.replace(PLAIN, energy_margin=0.5)
    a = member(hb("a", running=1), joules_per_step=3.0)
    pins = PinTable()
    pins.pin("sess", "a", 99.0)
    p = pick(policy, W, [a, member(hb("b", running=1), joules_per_step=1.0, in_flight=1)],
             RouteRequest(session_key="sess"), None, pins, NOW)
    assert sheet(p, "a").pin == 0.2 and p.member_id == "a"  # the old rule moved the session off its pin
    waiting = member(hb("b", running=1, waiting=1), joules_per_step=1.0)  # no free lane: 0.75 + 0.15 * 1/4 = 0.7875
    p = pick(policy, W, [a, waiting], RouteRequest(), None, None, NOW)
    assert not sheet(p, "b").has_free_lane and p.member_id == "a"
    # 1,000 characters of prefill queued: 0.5 * 0.6 * 250 / 2,000 tokens = 0.0375 more cost, within the margin
    queued = member(hb("b", running=1), joules_per_step=1.0, pending_prefill_chars=1000)
    p = pick(dataclasses.replace(policy, prefill_weight=0.5), W, [a, queued], RouteRequest(), None, None, NOW)
    assert sheet(p, "b").pending_prefill == pytest.approx(0.5 * 0.6 * 250 / 2000) and p.member_id == "a"


def test_the_tie_break_rests_while_the_pool_is_not_light() -> None:
    """Mean load of the routable members at 0.25 or more: no move (at offered load 0.8 the rule saved nothing and
    re-rolled the TTFT p90, docs/routing.md §3)."""
    policy = dataclasses.replace(PLAIN, energy_margin=0.5)
    a = member(hb("a", running=2), joules_per_step=3.0)  # 0.75 * 2/8 = 0.1875
    b = member(hb("b", running=2), joules_per_step=1.0, in_flight=1)  # 0.1875, later in the order
    assert pick(policy, W, [a, b], RouteRequest(), None, None, NOW).member_id == "b"  # mean 0.1875 < 0.25
    c = member(hb("c", running=6), joules_per_step=3.0)  # 0.5625: mean (0.1875 + 0.1875 + 0.5625) / 3 = 0.3125
    assert pick(policy, W, [a, b, c], RouteRequest(), None, None, NOW).member_id == "a"


# --- many gateways ----------------------------------------------------------------------------------------
def test_other_replicas_routes_are_booked_until_the_members_heartbeat_holds_them() -> None:
    fleet = Fleet("gw-1")
    fleet.observe(hb("n", ts_s=100.0), now_s=100.0)
    fleet.note_peer_route("n", 99.9)  # before the heartbeat: already in its running
    fleet.note_peer_route("n", 100.3)
    fleet.note_peer_route("n", 100.2)  # notes from two peers interleave
    assert fleet.peer_unseen("n") == 2
    m = member(fleet.record("n").heartbeat, peer_unseen=fleet.peer_unseen("n"))
    assert unseen_bookings(m) == 2
    p = pick(PLAIN, W, [m], RouteRequest(), None, None, NOW)
    assert sheet(p, "n").load == pytest.approx(0.75 * 2 / 8)
    fleet.observe(hb("n", ts_s=100.5, seq=2, running=2), now_s=100.5)
    assert fleet.peer_unseen("n") == 0


def test_a_peers_first_byte_teaches_affinity_and_the_session_pin() -> None:
    keys = prefix_hashes([{"role": "system", "content": "s" * 4000}, {"role": "user", "content": "u"}])
    affinity, pins = AffinityTable(), PinTable()
    record_peer_route(PoolPolicy(), keys, "sess-1", "b", affinity, pins, 99.0)
    assert affinity.lookup(keys, NOW) is not None and affinity.lookup(keys, NOW).member_id == "b"
    assert pins.get("sess-1", NOW) == "b"
    p = pick(PLAIN, W, [member(hb("a")), member(hb("b"))], RouteRequest(session_key="sess-1", prefix_keys=keys),
             affinity, pins, NOW)
    assert p.member_id == "b" and p.pinned_member == "b"


def test_route_sharing_applies_another_replicas_notes_and_ignores_its_own() -> None:
    from services.gateway.route_sharing import RouteSharing
    from services.gateway.routing_adapter import Router

    fleet, router = Fleet("gw-1"), Router(None, NOW)
    sharing = RouteSharing(None, "gw-1", "sess", fleet, router)  # type: ignore[arg-type]
    keys = prefix_hashes([{"role": "system", "content": "s" * 4000}])
    notes = RouteNotes(gateway_id="gw-2", session_id="x", seq=1, ts_s=NOW, notes=[
        RouteNote(kind="routed", member_id="b", routed_s=100.2, pending_chars=4000),
        RouteNote(kind="routed", member_id="b", routed_s=100.3, pending_chars=1000),
        RouteNote(kind="first_byte", member_id="b", routed_s=100.4,
                  prefix=[(k.digest, k.depth, k.prefix_chars) for k in keys], session_key="s-9"),
        RouteNote(kind="prefill_done", member_id="b", routed_s=100.4, pending_chars=4000),
    ])
    sharing.apply(notes, NOW)
    assert len(fleet.record("b").peer_route_times) == 2
    assert fleet.record("b").pending_prefill_chars == 4000 + 1000 - 4000  # the other replica's queued prefill
    assert router.affinity.lookup(keys, NOW).member_id == "b"  # type: ignore[union-attr]
    assert router.pins.get("s-9", NOW) == "b"


def test_the_pools_file_turns_the_energy_tie_break_on_per_pool() -> None:
    from proto import pools as pool_config
    from services.gateway.routing_adapter import policy_for

    members = [{"backend": "bus:w1", "model_id": "m"}]
    on = pool_config.parse({"model_pools": {"m": {"members": members, "energy_margin": 0.05}}})
    off = pool_config.parse({"model_pools": {"m": {"members": members}}})
    assert policy_for(on.pools["m"]).energy_margin == 0.05
    assert policy_for(off.pools["m"]).energy_margin == 0.0  # the default: off (docs/routing.md §3)
    assert pool_config.to_dict(on)["model_pools"]["m"]["energy_margin"] == 0.05
