"""The metric names a PromQL expression reads, for the tests that check shipped dashboards and alert rules
against real ``/metrics`` output.

prometheus_client has no PromQL parser, so this is a tokenizer that knows the grammar's shapes
(https://prometheus.io/docs/prometheus/latest/querying/basics/): string literals, label matchers ``{...}``,
range and subquery brackets ``[...]``, numbers and durations, function calls ``name(``, aggregation
modifiers (``by``/``without`` with their label lists), vector matching (``on``/``ignoring``/``group_left``/
``group_right`` with theirs), keywords and binary operators, and Grafana's template variables (``$var``,
``${var}``, ``[[var]]``, ``$__rate_interval``). What is left is an identifier in metric-name position.
A selector may also name its metric inside the braces (``{__name__="x"}``); that is read too, and a regex
name matcher is refused (no finite set of names to check).
"""

from __future__ import annotations

import re

AGGREGATIONS = frozenset({
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "limitk", "limit_ratio",
})
KEYWORDS = frozenset({"and", "or", "unless", "atan2", "bool", "offset", "start", "end"})
# keywords followed by a parenthesized list of label names
LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
NUMBER_WORDS = frozenset({"inf", "nan"})

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<gvar>\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*|\[\[[^\]]*\]\])
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?(?:(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<lbrace>\{)
  | (?P<lbracket>\[)
  | (?P<lparen>\()
  | (?P<rparen>\))
  | (?P<op>==|!=|<=|>=|=~|!~|[-+*/%^<>=,@])
""", re.VERBOSE)


class PromQLError(ValueError):
    """An expression this reader cannot take apart (unbalanced brackets, an unknown character, a regex
    name matcher)."""


def _skip_balanced(expr: str, start: int, opening: str, closing: str) -> tuple[int, str]:
    """From ``expr[start] == opening``, the index after its matching ``closing`` and the text between,
    skipping string literals (a ``}`` inside ``"..."`` closes nothing; backslash escapes inside ``"``
    and ``'``, none inside backquotes)."""
    depth, i, quote = 0, start, ""
    while i < len(expr):
        c = expr[i]
        if quote:
            if c == "\\" and quote != "`":
                i += 2
                continue
            if c == quote:
                quote = ""
        elif c in "\"'`":
            quote = c
        elif c == opening:
            depth += 1
        elif c == closing:
            depth -= 1
            if depth == 0:
                return i + 1, expr[start + 1 : i]
        i += 1
    raise PromQLError(f"unbalanced {opening!r} (or an unterminated string) at {start} in {expr!r}")


_NAME_MATCHER = re.compile(r"""__name__\s*(=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)""")


def _names_in_matchers(body: str, expr: str) -> set[str]:
    names = set()
    for op, quoted in _NAME_MATCHER.findall(body):
        if op != "=":
            raise PromQLError(f"__name__{op} matches no finite set of names: {expr!r}")
        names.add(quoted[1:-1])
    return names


def metric_names(expr: str) -> set[str]:
    """Every metric name ``expr`` selects (series names as written: ``x_bucket``, ``y_total``)."""
    names: set[str] = set()
    tokens: list[tuple[str, str]] = []  # (kind, text), brackets already consumed
    i = 0
    while i < len(expr):
        m = _TOKEN.match(expr, i)
        if m is None:
            raise PromQLError(f"unexpected {expr[i]!r} at {i} in {expr!r}")
        kind = m.lastgroup
        assert kind is not None
        if kind == "lbrace":
            i, body = _skip_balanced(expr, i, "{", "}")
            names |= _names_in_matchers(body, expr)
            tokens.append(("matchers", body))
            continue
        if kind == "lbracket":
            i, _ = _skip_balanced(expr, i, "[", "]")  # a range, a subquery or a Grafana interval
            tokens.append(("range", ""))
            continue
        i = m.end()
        if kind not in ("space", "comment"):
            tokens.append((kind, m.group()))
    depth = 0
    label_list_depth: int | None = None  # inside by(...)/on(...) ...: identifiers there are label names
    for n, (kind, text) in enumerate(tokens):
        following = tokens[n + 1][0] if n + 1 < len(tokens) else ""
        if kind == "lparen":
            depth += 1
        elif kind == "rparen":
            if label_list_depth == depth:
                label_list_depth = None
            depth -= 1
            if depth < 0:
                raise PromQLError(f"unbalanced ')' in {expr!r}")
        elif kind == "ident":
            word = text.lower()
            if label_list_depth is not None:
                continue
            if word in LABEL_LIST_KEYWORDS:
                if following == "lparen":
                    label_list_depth = depth + 1
                continue
            if following == "lparen" or word in KEYWORDS or word in AGGREGATIONS or word in NUMBER_WORDS:
                continue  # a function call, a keyword, an aggregation written without its parenthesis here
            names.add(text)
    if depth != 0:
        raise PromQLError(f"unbalanced '(' in {expr!r}")
    return names


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?P<selector>.*?)\s*,\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*$", re.S)


def template_query_names(query: str) -> set[str]:
    """The metric names a Grafana Prometheus template variable query reads: ``label_values(sel, label)``,
    ``query_result(expr)`` or ``metrics(...)``-free PromQL; ``label_values(label)`` and ``label_names()``
    read no metric."""
    q = query.strip()
    if not q or q.startswith("label_names(") or re.fullmatch(r"label_values\(\s*[A-Za-z_]\w*\s*\)", q):
        return set()
    if (m := _LABEL_VALUES.match(q)) is not None:
        return metric_names(m.group("selector"))
    if q.startswith("query_result(") and q.endswith(")"):
        return metric_names(q[len("query_result("):-1])
    return metric_names(q)


HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def missing_names(names: set[str], families: dict[str, str], samples: set[str]) -> set[str]:
    """Which of ``names`` an exposition does not define. ``families``: family name -> type as
    prometheus_client's parser reads it (counter families without ``_total``); ``samples``: every series
    name present. A name is defined when a series of that name is present, or when its family is declared
    (possibly with no samples yet) with the type the name implies: ``x_bucket``/``x_sum``/``x_count`` a
    histogram (or a summary, for ``_sum``/``_count``), ``x_total`` a counter, a bare name a gauge."""
    missing = set()
    for name in names:
        if name in samples:
            continue
        suffix = next((s for s in HISTOGRAM_SUFFIXES if name.endswith(s)), None)
        if suffix is not None:
            kinds = {"histogram"} if suffix == "_bucket" else {"histogram", "summary"}
            if families.get(name.removesuffix(suffix)) in kinds:
                continue
        if name.endswith("_total") and families.get(name.removesuffix("_total")) == "counter":
            continue
        if families.get(name) == "gauge":
            continue
        missing.add(name)
    return missing
