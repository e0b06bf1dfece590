"""Pure: one member's circuit breaker, fed by the outcomes of the requests the gateway sends it.

A member is judged by its answers, not only by its scrapes (issue #24: a member that broke every stream after
the first byte kept being chosen, 6/6). Every failure (a connect error, a 5xx or a timeout before the first
byte, a stream that breaks after it) opens the breaker for a cooldown that doubles with each consecutive
failure, from :data:`BASE_COOLDOWN_S` up to :data:`MAX_COOLDOWN_S`. When it ends the breaker is half-open: one
request may go to the member (the probe) while the others still avoid it; the probe's success closes the
breaker, its failure opens it again for twice as long. Any success closes it. A probe that neither succeeds
nor fails within :data:`PROBE_TIMEOUT_S` (a long stream still running) lets another request probe.

States: ``closed`` (routable), ``open`` (excluded as ``down``), ``half_open`` (routable by one request at a
time). The clock is passed in (wall-clock seconds, like the rest of the fleet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

BASE_COOLDOWN_S = 5.0
MAX_COOLDOWN_S = 60.0
PROBE_TIMEOUT_S = 30.0

BreakerState = Literal["closed", "open", "half_open"]
FailureKind = Literal["connect", "status", "timeout", "after_first_byte", "credentials"]
STATE_CODE: dict[BreakerState, int] = {"closed": 0, "half_open": 1, "open": 2}  # the /metrics gauge


@dataclass
class Breaker:
    consecutive_failures: int = 0
    open_until_s: float = 0.0
    opened_at_s: float = 0.0
    probe_since_s: float | None = None
    last_failure: FailureKind | None = None
    failures_total: int = 0

    def state(self, now_s: float) -> BreakerState:
        if self.consecutive_failures == 0:
            return "closed"
        return "open" if now_s < self.open_until_s else "half_open"

    def routable(self, now_s: float) -> bool:
        """May a request go to the member now? Half-open: only while no probe is out."""
        state = self.state(now_s)
        if state != "half_open":
            return state == "closed"
        return self.probe_since_s is None or now_s - self.probe_since_s >= PROBE_TIMEOUT_S

    def on_attempt(self, now_s: float) -> None:
        """A request is being sent: in half-open it is the probe."""
        if self.state(now_s) == "half_open":
            self.probe_since_s = now_s

    def on_failure(self, now_s: float, kind: FailureKind) -> None:
        self.consecutive_failures += 1
        self.failures_total += 1
        self.last_failure = kind
        cooldown = min(BASE_COOLDOWN_S * 2 ** (self.consecutive_failures - 1), MAX_COOLDOWN_S)
        self.opened_at_s = now_s
        self.open_until_s = now_s + cooldown
        self.probe_since_s = None

    def on_success(self) -> None:
        self.consecutive_failures = 0
        self.open_until_s = 0.0
        self.probe_since_s = None

    def reset(self) -> None:
        """The member is a new process, or a bus worker heard again on its connection: forget the failures."""
        self.on_success()

    def describe(self, now_s: float) -> dict[str, object]:
        """For /backends: the state, how long it stays open, and the failures that opened it."""
        state = self.state(now_s)
        return {"state": state, "consecutive_failures": self.consecutive_failures,
                "open_for_s": round(self.open_until_s - now_s, 3) if state == "open" else 0.0,
                "last_failure": self.last_failure, "failures_total": self.failures_total}
