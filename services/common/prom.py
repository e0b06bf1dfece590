"""Prometheus text exposition (format 0.0.4) and histograms, for every service's ``/metrics``. Pure.

(The engine exposes three families of names at once so existing dashboards read it unchanged:
``vllm:*``, ``llamacpp:*`` and ``ninfer:*``; see services/engine/serve/views.py.)
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# Histogram buckets as vLLM v1 declares them (vllm/v1/metrics/loggers.py, PrometheusStatLogger), so a dashboard
# written for vLLM computes the same quantiles from our engine. Seconds unless the name says tokens.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# inter_token_latency_seconds, time_per_output_token_seconds, request_time_per_output_token_seconds
INTER_TOKEN_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
# e2e_request_latency_seconds and the request phase histograms (queue, inference, prefill, decode)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50 ... up to ``max_value`` (vLLM's ``build_1_2_5_buckets``: its token-count
    histograms' buckets, bounded by the model's context length)."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


@dataclass
class Histogram:
    """Cumulative-bucket histogram; ``observe`` in seconds."""

    buckets: Sequence[float]
    counts: list[int] = field(init=False)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.count += 1

    def up_to(self, max_bound: float) -> Histogram:
        """The same observations with only the buckets at or below ``max_bound`` (exact: buckets are
        cumulative, so dropping the upper ones moves their counts into +Inf and changes nothing else)."""
        n = bisect.bisect_right(self.buckets, max_bound)
        twin = Histogram(tuple(self.buckets[:n]), total=self.total, count=self.count)
        twin.counts = list(self.counts[:n])
        return twin

    def copy(self) -> Histogram:
        """An independent copy (a snapshot another thread may read while this one keeps counting)."""
        twin = Histogram(self.buckets, total=self.total, count=self.count)
        twin.counts = list(self.counts)
        return twin


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _number(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


# The text format's media type, version included (scrapers such as the production-stack router and older
# Prometheus versions pick the parser by it).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class PromText:
    """Builds one exposition; each metric family is declared once with HELP and TYPE, and its samples are
    written together under it whatever order they were added in (per-member rows added member by member
    would otherwise interleave families, and a parser reads a family's stray later samples as untyped)."""

    def __init__(self) -> None:
        self._families: dict[str, list[str]] = {}  # name -> HELP, TYPE, then its samples; insertion-ordered

    def _family(self, name: str, kind: str, help_text: str) -> list[str]:
        lines = self._families.get(name)
        if lines is None:
            escaped = help_text.replace("\\", "\\\\").replace("\n", "\\n")  # the format's HELP escapes
            lines = self._families[name] = [f"# HELP {name} {escaped}", f"# TYPE {name} {kind}"]
        return lines

    def declare(self, name: str, kind: str, help_text: str) -> None:
        """Declare a family (HELP and TYPE) that may get no samples: a labelled counter nothing has counted
        yet is still a known, typed name to scrapers and dashboards (prometheus_client does the same)."""
        self._family(name, kind, help_text)

    def gauge(self, name: str, help_text: str, value: float | None, labels: Mapping[str, str] = {}) -> None:
        if value is None:  # unknown is absent, never a made-up 0
            return
        self._family(name, "gauge", help_text).append(f"{name}{_labels(labels)} {_number(value)}")

    def counter(self, name: str, help_text: str, value: float | None, labels: Mapping[str, str] = {}) -> None:
        """``name`` ends in ``_total``; the family is declared under the same name."""
        if value is None:
            return
        self._family(name, "counter", help_text).append(f"{name}{_labels(labels)} {_number(value)}")

    def histogram(self, name: str, help_text: str, hist: Histogram, labels: Mapping[str, str] = {}) -> None:
        lines = self._family(name, "histogram", help_text)
        cumulative = 0
        for bound, n in zip(hist.buckets, hist.counts, strict=True):
            cumulative += n
            lines.append(f"{name}_bucket{_labels({**labels, 'le': _number(float(bound))})} {cumulative}")
        lines.append(f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {hist.count}")
        lines.append(f"{name}_sum{_labels(labels)} {_number(hist.total)}")
        lines.append(f"{name}_count{_labels(labels)} {hist.count}")

    def render(self) -> str:
        return "\n".join(line for lines in self._families.values() for line in lines) + "\n"
