"""Stop strings on streamed text: what to emit now, what to hold back, and whether to stop.

Text arrives in deltas (one per detokenized step) and a stop string may span deltas, so the scanner
holds back the longest tail of the unemitted text that is still a proper prefix of some stop string;
it is released as soon as the next delta rules the match out. The stop string itself is never emitted,
nor anything after it (OpenAI semantics: the output is truncated at the earliest match).

Why scanning ``held_back + delta`` suffices: every match starts inside it. A match starting in text
already emitted would have made that text's tail a prefix of the stop string when it was scanned, and
such a tail is held back, never emitted.

Pure: no I/O, no clock. :func:`scan_stop` is the function; :class:`StopChecker` keeps ``held_back``
between calls for one request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopScan:
    """Result of one scan.

    ``text_to_emit``: safe to send now. ``held_back``: unemitted text to pass to the next scan (empty
    once stopped). ``is_stopped``: a stop string matched; ``stop_string`` is the one that did.
    """

    text_to_emit: str
    held_back: str
    is_stopped: bool
    stop_string: str | None = None


def scan_stop(held_back: str, delta: str, stop: Sequence[str]) -> StopScan:
    """Scan ``held_back + delta`` for the earliest stop-string match (ties: the first in ``stop``)."""
    text = held_back + delta
    if not stop:
        return StopScan(text, "", False)
    best_at = -1
    best: str | None = None
    for s in stop:
        at = text.find(s)
        if at != -1 and (best_at == -1 or at < best_at):
            best_at, best = at, s
    if best is not None:
        return StopScan(text[:best_at], "", True, best)
    keep = _longest_partial_match(text, stop)
    cut = len(text) - keep
    return StopScan(text[:cut], text[cut:], False)


def _longest_partial_match(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class StopChecker:
    """One request's incremental stop-string state: feed deltas, emit what comes back, flush at the end."""

    __slots__ = ("held_back", "is_stopped", "stop")

    def __init__(self, stop: Sequence[str]) -> None:
        if any(s == "" for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = tuple(stop)
        self.held_back = ""
        self.is_stopped = False

    def feed(self, delta: str) -> StopScan:
        """Scan a new delta. After a stop, further deltas are ignored (emit nothing)."""
        if self.is_stopped:
            return StopScan("", "", True)
        result = scan_stop(self.held_back, delta, self.stop)
        self.held_back = result.held_back
        self.is_stopped = result.is_stopped
        return result

    def flush(self) -> str:
        """The held-back text, to emit when generation ends for another reason (length, EOS)."""
        text, self.held_back = ("" if self.is_stopped else self.held_back), ""
        return text
