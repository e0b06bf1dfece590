"""A Prometheus text-format (0.0.4) parser. Pure: a string in, an :class:`Exposition` out.

Engines' ``/metrics`` bodies are read with a real tokenizer, not per-metric regexes over lines: label
values may hold escaped quotes, backslashes and newlines, ``,``, ``}``, ``#`` and spaces; values may be
``NaN``/``+Inf``/``-Inf``; samples may carry a millisecond timestamp (and, from OpenMetrics-minded
exporters, a trailing ``# {…} v`` exemplar, which is skipped). ``# HELP``/``# TYPE`` declare a family;
``_bucket``/``_sum``/``_count`` (histograms, summaries) and ``_total``/``_created`` (counters, as
prometheus_client writes them) are the family's samples. Other ``#`` lines are comments.

Cost matters (telemetry reads 200 engines a second, and a vLLM ``/metrics`` is hundreds of lines of
histogram buckets), so :func:`parse` takes ``keep``: the families whose samples are worth parsing. A
skipped line costs one name scan; its labels and value are never looked at. A malformed line that is
kept raises :class:`PromParseError` (as Prometheus fails a scrape), naming the line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = ["Exposition", "Family", "PromParseError", "Sample", "parse"]

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# One label pair: name, '=', a quoted value whose escapes (\\ \" \n) never end it; then an optional ','.
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,?)\s*', re.DOTALL)
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
_UNESCAPE = {"\\": "\\", '"': '"', "n": "\n"}
_HELP_UNESCAPE = {"\\": "\\", "n": "\n"}  # HELP text escapes only backslash and newline
_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created", "_info")
_SPECIAL = {"nan": math.nan, "+inf": math.inf, "inf": math.inf, "-inf": -math.inf}


class PromParseError(ValueError):
    """A line that is not Prometheus text: ``line_no`` counts from 1."""

    def __init__(self, line_no: int, reason: str, line: str) -> None:
        super().__init__(f"line {line_no}: {reason}: {line[:120]!r}")
        self.line_no = line_no
        self.reason = reason
        self.line = line


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float
    timestamp_ms: int | None = None


@dataclass(slots=True)
class Family:
    """One metric family; ``type`` is ``untyped`` until a ``# TYPE`` line says otherwise."""

    name: str
    type: str = "untyped"
    help: str = ""
    samples: list[Sample] = field(default_factory=list)


@dataclass(slots=True)
class Exposition:
    """Families in the order first seen, and every kept sample indexed by its own name."""

    families: dict[str, Family] = field(default_factory=dict)
    by_name: dict[str, list[Sample]] = field(default_factory=dict)

    def samples(self, name: str) -> list[Sample]:
        """Samples called ``name``, accepting a counter written with or without ``_total``."""
        found = self.by_name.get(name)
        if found is None:
            alias = name.removesuffix("_total") if name.endswith("_total") else name + "_total"
            found = self.by_name.get(alias, [])
        return found

    def has_prefix(self, prefix: str) -> bool:
        return any(name.startswith(prefix) for name in self.families)

    def total(self, *names: str) -> float | None:
        """Sum over label sets of the first of ``names`` present (e.g. vLLM's per-engine gauges);
        None when none is present or any value is NaN (unknown, not 0)."""
        for name in names:
            found = self.samples(name)
            if found:
                value = math.fsum(s.value for s in found)
                return None if math.isnan(value) else value
        return None

    def mean(self, *names: str) -> float | None:
        """Mean over label sets of the first of ``names`` present (ratios such as KV usage)."""
        for name in names:
            found = self.samples(name)
            if found:
                value = math.fsum(s.value for s in found) / len(found)
                return None if math.isnan(value) else value
        return None


def _family_of(name: str, current: Family | None) -> str:
    """The family a sample belongs to: the declared one when its name extends it, else its own name."""
    if current is not None:
        base = current.name
        if name == base:
            return base
        if name.startswith(base) and name[len(base):] in _SUFFIXES:
            return base
        stem = base.removesuffix("_total")
        if stem != base and name == stem + "_created":  # prometheus_client: TYPE x_total, sample x_created
            return base
    return name


def _value(text: str) -> float:
    special = _SPECIAL.get(text.lower())
    if special is not None:
        return special
    if "_" in text:  # Python's float() takes 1_000; Prometheus does not
        raise ValueError(text)
    return float(text)


def _unescape(value: str, table: Mapping[str, str] = _UNESCAPE) -> str:
    """Undo the format's escapes; an unknown escape is kept as written (lenient: one odd exporter
    must not cost a whole scrape)."""
    return _ESCAPE.sub(lambda m: table.get(m.group(1), m.group(0)), value) if "\\" in value else value


def _labels(line: str, pos: int, line_no: int) -> tuple[dict[str, str], int]:
    """Parse ``{…}`` starting after the ``{`` at ``pos``; returns the labels and the index after ``}``."""
    labels: dict[str, str] = {}
    while True:
        if line.startswith("}", pos):
            return labels, pos + 1
        m = _LABEL.match(line, pos)
        if m is None:
            # whitespace before the closing brace is allowed
            stripped = len(line) - len(line[pos:].lstrip())
            if line.startswith("}", stripped):
                return labels, stripped + 1
            raise PromParseError(line_no, "malformed label set", line)
        labels[m.group(1)] = _unescape(m.group(2))
        pos = m.end()
        if not m.group(3) and not line.startswith("}", pos):
            raise PromParseError(line_no, "expected ',' or '}' between labels", line)


def _sample(line: str, line_no: int, name: str, pos: int) -> Sample:
    labels: Mapping[str, str] = {}
    brace = line.find("{", pos)
    if brace >= 0 and not line[pos:brace].strip():  # blanks may separate the name from its labels
        labels, pos = _labels(line, brace + 1, line_no)
    # after the labels no quoted text remains, so a '#' can only start an exemplar
    tokens = line[pos:].partition("#")[0].split()
    if not 1 <= len(tokens) <= 2:
        raise PromParseError(line_no, "expected a value and an optional timestamp", line)
    try:
        value = _value(tokens[0])
        timestamp = int(tokens[1]) if len(tokens) == 2 else None
    except ValueError:
        raise PromParseError(line_no, "value or timestamp is not a number", line) from None
    return Sample(name, labels, value, timestamp)


def _declaration(line: str, families: dict[str, Family]) -> Family | None:
    """Apply a ``# HELP`` or ``# TYPE`` line; returns the declared family (None for a plain comment)."""
    parts = line[1:].lstrip().split(None, 2)
    if len(parts) < 2 or parts[0] not in ("HELP", "TYPE") or not _NAME.fullmatch(parts[1]):
        return None
    family = families.get(parts[1])
    if family is None:
        family = families[parts[1]] = Family(parts[1])
    text = parts[2].strip() if len(parts) > 2 else ""
    if parts[0] == "TYPE":
        family.type = text.lower() or "untyped"
    else:
        family.help = _unescape(text, _HELP_UNESCAPE)
    return family


def parse(text: str, keep: Callable[[str], bool] | None = None) -> Exposition:
    """Parse a whole exposition. ``keep(family_name)`` False skips that family's samples unparsed."""
    out = Exposition()
    current: Family | None = None
    kept: dict[str, bool] = {}
    for line_no, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip()
        if not line:
            continue
        if line[0] == "#":
            declared = _declaration(line, out.families)
            if declared is not None:
                current = declared
            continue
        m = _NAME.match(line)
        if m is None:
            raise PromParseError(line_no, "expected a metric name", line)
        name = m.group(0)
        family_name = _family_of(name, current)
        wanted = kept.get(family_name)
        if wanted is None:
            wanted = kept[family_name] = keep is None or keep(family_name)
        if not wanted:
            continue
        sample = _sample(line, line_no, name, m.end())
        family = out.families.get(family_name)
        if family is None:
            family = out.families[family_name] = Family(family_name)
        if current is None or current.name != family_name:
            current = family
        family.samples.append(sample)
        out.by_name.setdefault(name, []).append(sample)
    return out

