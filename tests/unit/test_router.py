import pytest

from proto import SlotHeartbeat
from services.gateway.router import MemberState, load_score, pick_member, unseen_bookings


def hb(worker: str = "w1", *, lanes: int | None = 8, running: int | None = 0, waiting: int | None = 0,
       kv_usage: float | None = 0.0, evictions: int | None = 0, seq: int = 1, state: str = "ready") -> SlotHeartbeat:
    return SlotHeartbeat(worker_id=worker, session_id="s", seq=seq, ts_s=0.0, model_id="m", lanes=lanes,
                         running=running, waiting=waiting, kv_usage=kv_usage, kv_evictions_total=evictions,
                         state=state)  # type: ignore[arg-type]


def member(h: SlotHeartbeat, *, received_s: float = 100.0, routed: int = 0, admitted: int | None = 0,
           in_flight: int = 0, previous: SlotHeartbeat | None = None) -> MemberState:
    return MemberState(h.worker_id, h, previous, received_s, routed, admitted, in_flight)


def test_native_score_is_three_quarters_lanes_plus_queue_plus_kv() -> None:
    # 4 of 8 lanes busy, nothing waiting, no KV pressure: 0.75 * 4/8 = 0.375
    assert load_score(hb(running=4)) == pytest.approx(0.75 * 4 / 8)
    # all lanes busy and 2 waiting: laneP = 1, queueP = min(2 / (8/2), 1) = 0.5
    assert load_score(hb(running=8, waiting=2)) == pytest.approx(0.75 * 1 + 0.15 * 0.5)
    # anything waiting makes laneP 1 even with free lanes
    assert load_score(hb(running=2, waiting=1)) == pytest.approx(0.75 * 1 + 0.15 * (1 / 4))


def test_kv_pressure_counts_when_evictions_rose_since_the_previous_heartbeat() -> None:
    before = hb(evictions=3, seq=1)
    after = hb(evictions=5, seq=2, running=4)
    assert load_score(after, before) == pytest.approx(0.75 * 4 / 8 + 0.10 * 1)
    assert load_score(after, hb(evictions=5, seq=1)) == pytest.approx(0.75 * 4 / 8)


def test_engines_without_a_lane_signal_score_zero() -> None:
    assert load_score(hb(lanes=None, running=None, waiting=None)) == 0.0


def test_only_bookings_the_heartbeat_has_not_seen_are_added() -> None:
    # 5 routed here, the engine has admitted 3 of them: 2 are unseen; 4 still open.
    m = member(hb(running=3), routed=5, admitted=3, in_flight=4)
    assert unseen_bookings(m) == 5 - 3
    # booked requests fill lanes before anything is counted as waiting: (3 + 2) / 8 lanes
    assert load_score(m.heartbeat, None, unseen_bookings(m)) == pytest.approx(0.75 * 5 / 8)


def test_pick_takes_the_least_loaded_live_member_and_says_why() -> None:
    busy, idle = member(hb("a", running=6)), member(hb("b", running=1))
    pick = pick_member([busy, idle], now_s=101.0, stale_after_s=3.0)
    assert pick.worker_id == "b" and pick.reason == "least_loaded"
    assert {c.worker_id: c.score for c in pick.candidates} == pytest.approx({"a": 0.75 * 6 / 8, "b": 0.75 * 1 / 8})


def test_stale_and_draining_members_are_not_picked() -> None:
    stale = member(hb("a"), received_s=90.0)
    draining = member(hb("b", state="draining"))
    live = member(hb("c", running=7))
    assert pick_member([stale, draining, live], now_s=100.5, stale_after_s=3.0).worker_id == "c"
    assert pick_member([stale, draining], now_s=100.5, stale_after_s=3.0).worker_id is None


def test_ties_go_to_more_lanes_then_to_the_lower_id() -> None:
    small, big = member(hb("a", lanes=4)), member(hb("b", lanes=16))
    assert pick_member([small, big], now_s=100.0, stale_after_s=3.0).worker_id == "b"
    assert pick_member([member(hb("z")), member(hb("y"))], now_s=100.0, stale_after_s=3.0).worker_id == "y"
