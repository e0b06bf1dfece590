"""services/gateway/breaker.py: a member's circuit breaker, from request outcomes (issue #24)."""

from __future__ import annotations

from services.gateway.breaker import BASE_COOLDOWN_S, MAX_COOLDOWN_S, PROBE_TIMEOUT_S, Breaker


def test_a_failure_opens_it_for_the_base_cooldown_then_one_probe_may_go() -> None:
    b = Breaker()
    assert b.state(0.0) == "closed" and b.routable(0.0)
    b.on_failure(10.0, "after_first_byte")
    assert b.state(10.0 + BASE_COOLDOWN_S - 0.01) == "open" and not b.routable(10.0 + BASE_COOLDOWN_S - 0.01)
    t = 10.0 + BASE_COOLDOWN_S
    assert b.state(t) == "half_open" and b.routable(t)
    b.on_attempt(t)  # the probe
    assert not b.routable(t + 1.0)  # the others still avoid it
    assert b.routable(t + PROBE_TIMEOUT_S)  # a probe that never ends lets another one try
    b.on_success()
    assert b.state(t + 1.0) == "closed" and b.consecutive_failures == 0


def test_consecutive_failures_double_the_cooldown_up_to_the_cap() -> None:
    b = Breaker()
    now, cooldowns = 0.0, []
    for _ in range(6):
        b.on_failure(now, "status")
        cooldowns.append(b.open_until_s - now)
        now = b.open_until_s  # the probe goes out and fails
        b.on_attempt(now)
    assert cooldowns == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0][:len(cooldowns)]
    assert max(cooldowns) == MAX_COOLDOWN_S
    assert b.describe(now)["state"] == "half_open" and b.describe(now)["failures_total"] == 6


def test_describe_says_how_long_it_stays_open_and_why() -> None:
    b = Breaker()
    b.on_failure(100.0, "connect")
    assert b.describe(101.0) == {"state": "open", "consecutive_failures": 1, "open_for_s": 4.0,
                                 "last_failure": "connect", "failures_total": 1}
