"""ThrottledLog: one line per kind per period, then a count of what was held back."""

from __future__ import annotations

import logging

from services.common.runtime import ThrottledLog


def test_repeats_within_the_period_are_held_back_and_counted(caplog) -> None:  # type: ignore[no-untyped-def]
    now = [100.0]
    quiet = ThrottledLog(logging.getLogger("t"), every_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="t"):
        for i in range(50):
            quiet.warning("down", "member %s down (%d)", "e1", i)
            now[0] += 0.1
        quiet.warning("other", "another kind %d", 1)
        now[0] = 111.0
        quiet.warning("down", "member %s down (%d)", "e1", 99)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "member e1 down (0)"
    assert lines[1] == "another kind 1"
    assert lines[2] == "member e1 down (99) (and 49 more like it in the last 11 s)"
    assert len(lines) == 3
