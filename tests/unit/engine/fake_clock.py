"""The engine tests' clock: a fake monotonic clock that moves 1 ms each time it is read."""

from __future__ import annotations


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        self.t += 0.001
        return self.t
