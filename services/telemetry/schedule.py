"""Pure: when a member's scrape loop fires. Times are ``time.monotonic()`` seconds, passed in.

Each member scrapes on its own grid ``tick + k·interval``, offset by a stable phase so 200 members do
not all fire in the same millisecond. The interval may change while telemetry runs (a pools file's
``metrics.poll_interval`` saved on a gateway's Config page, when ``--interval`` was not given): the grid
then continues from the member's last tick with the new interval, so neither a shorter nor a longer one
waits out the old.
"""

from __future__ import annotations

import zlib

MIN_INTERVAL_S = 0.1  # issue 6: the heartbeat rate is "tunable down to 100 ms"
DEFAULT_INTERVAL_S = 1.0  # as the pools file's metrics.poll_interval defaults (proto/pools.py)
DEFAULT_TIMEOUT_S = 2.0  # --timeout: one request's deadline, before the interval bounds it
# The shortest deadline a request gets however short the interval: loopback answers in milliseconds, a member
# across a data centre in tens of them; 250 ms leaves room for a loaded host without holding a 0.1 s loop long.
MIN_REQUEST_TIMEOUT_S = 0.25


def request_timeout_s(timeout_s: float, interval_s: float) -> float:
    """Each request's deadline: ``--timeout`` (2 s), at most the scrape interval (a request may not outlive
    the tick it serves by much), but never under :data:`MIN_REQUEST_TIMEOUT_S` nor above ``timeout_s``."""
    return min(timeout_s, max(interval_s, MIN_REQUEST_TIMEOUT_S))


def phase_s(member_id: str, interval_s: float) -> float:
    """A stable offset within the interval (crc32 of the id, in thousandths), spreading scrapes evenly."""
    return interval_s * (zlib.crc32(member_id.encode()) % 1000) / 1000


def next_tick_s(tick_s: float, interval_s: float, now_s: float) -> float:
    """The first tick ``tick_s + k·interval_s`` (k ≥ 1) that is not in the past.

    A scrape that overran its interval skips the ticks it missed rather than bursting to catch up.
    """
    next_s = tick_s + interval_s
    if next_s < now_s:
        next_s += interval_s * ((now_s - next_s) // interval_s + 1)
    return next_s
