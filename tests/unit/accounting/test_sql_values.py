"""The one serialiser of operator-SQL values (services/accounting/sql_values.py; docs/accounting.md, "Types"):
each DuckDB type as the JSON both answers carry, and nothing that is not standard JSON."""

from __future__ import annotations

import datetime as dt
import json
import math
from typing import Any

import duckdb
import msgspec
import pytest

from services.accounting.sql_values import encoded_size, iso_duration, json_row, json_value


@pytest.fixture(scope="module")
def con() -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(":memory:")
    con.execute("SET TimeZone = 'UTC'")
    con.execute("CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')")
    return con


# (SQL expression, the JSON value): the type table of docs/accounting.md, one row per DuckDB type
TYPE_TABLE: list[tuple[str, Any]] = [
    ("INTERVAL '1 day 2 hours 3 minutes 4.5 seconds'", "P1DT2H3M4.5S"),
    ("INTERVAL '1 month'", "P30D"),  # DuckDB's Python client: a month is 30 days
    ("INTERVAL '-90 minutes'", "-PT1H30M"),
    ("INTERVAL '0 seconds'", "PT0S"),
    ("TIME '03:04:05.25'", "03:04:05.250000"),
    ("TIMETZ '03:04:05+02'", "03:04:05+02:00"),
    ("UUID 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
    ("1.25::DECIMAL(10, 2)", 1.25),
    ("'\\xAA\\x00'::BLOB", "aa00"),
    ("170141183460469231731687303715884105727::HUGEINT", 2**127 - 1),
    ("[1, NULL, 3]", [1, None, 3]),
    ("[1.5, 'nan'::DOUBLE]", [1.5, "NaN"]),
    ("{'a': 1, 'b': [TIME '01:00:00']}", {"a": 1, "b": ["01:00:00"]}),
    ("MAP {'k': 1, 'l': 2}", {"k": 1, "l": 2}),
    ("MAP {1: 'x', 2: 'y'}", {"1": "x", "2": "y"}),
    ("MAP {[1]: 'x'}", {"key": [[1]], "value": ["x"]}),  # list keys: DuckDB's own key/value form
    ("'happy'::mood", "happy"),
    ("DATE '2026-03-01'", "2026-03-01"),
    ("TIMESTAMP '2026-03-01 12:00:00.5'", "2026-03-01T12:00:00.500000"),
    ("TIMESTAMPTZ '2026-03-01 12:00:00+02'", "2026-03-01T10:00:00+00:00"),
    ("'nan'::DOUBLE", "NaN"),
    ("'inf'::DOUBLE", "Infinity"),
    ("'-inf'::FLOAT", "-Infinity"),
    ("[1, 2]::INTEGER[2]", [1, 2]),  # ARRAY: a tuple in Python
    ("'101'::BIT", "101"),
    ("union_value(k := 2)", 2),
    ("NULL", None),
    ("true", True),
]


@pytest.mark.parametrize(("expression", "expected"), TYPE_TABLE)
def test_each_duckdb_type_becomes_the_documented_json_value(con: duckdb.DuckDBPyConnection, expression: str,
                                                            expected: Any) -> None:
    (value,) = con.execute(f"SELECT {expression}").fetchone() or (None,)
    converted = json_value(value)
    assert converted == expected
    # standard JSON: the stdlib refuses NaN/Infinity with allow_nan=False, and both encoders agree
    assert json.loads(json.dumps(converted, allow_nan=False)) == msgspec.json.decode(msgspec.json.encode(converted))


def test_every_column_of_duckdbs_all_types_table_serialises_to_standard_json(con: duckdb.DuckDBPyConnection) -> None:
    cursor = con.execute("SELECT * FROM test_all_types()")
    rows = cursor.fetchall()
    assert len(rows) == 3 and len(cursor.description or []) > 50  # min, max and NULL of every type
    for row in rows:
        converted = json_row(row)
        text = json.dumps(converted, allow_nan=False)  # raises on NaN/Infinity or a non-JSON type
        assert json.loads(text) == converted
        assert encoded_size(converted) == len(msgspec.json.encode(converted))


@pytest.mark.parametrize(("delta", "text"), [
    (dt.timedelta(0), "PT0S"),
    (dt.timedelta(microseconds=1), "PT0.000001S"),
    (dt.timedelta(seconds=59), "PT59S"),
    (dt.timedelta(days=2), "P2D"),
    (dt.timedelta(days=1, hours=1, minutes=1, seconds=1), "P1DT1H1M1S"),
    (-dt.timedelta(hours=25), "-P1DT1H"),
])
def test_iso_duration_writes_days_hours_minutes_and_seconds(delta: dt.timedelta, text: str) -> None:
    assert iso_duration(delta) == text


def test_non_finite_floats_become_strings_never_null_and_finite_floats_stay_numbers() -> None:
    assert [json_value(v) for v in (math.nan, math.inf, -math.inf, 1.5, -0.0)] == [
        "NaN", "Infinity", "-Infinity", 1.5, -0.0]
