"""The one serialiser of operator-SQL values: what DuckDB's Python client returns → standard JSON values.

Both answers to an operator query, ``POST /sql`` (HTTP) and ``llm.v1.accounting.sql`` (the bus, and
``llmgw sql`` in file mode), convert every row with :func:`json_row` and count its bytes with
:func:`encoded_size`, so the two paths give the same values and share one byte cap (docs/accounting.md,
"SQL for operators", the type table). Pure: no DuckDB, no I/O.

Why convert here and not in the encoder: ``json.dumps`` (aiohttp's ``json_response``) fails on UUID,
time and timedelta values (a 500) and writes NaN/Infinity, which is not JSON (RFC 8259 §6); msgspec
writes NaN as null (a NULL that is not one) and datetimes in its own form. After :func:`json_value`
only str, int, float (finite), bool, None, list and dict with str keys remain, which every JSON encoder
writes alike.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec

_encoder = msgspec.json.Encoder()

NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}
"""A non-finite DOUBLE/FLOAT becomes one of these strings, or ``"NaN"`` (as PostgreSQL's ``to_json``)."""


def iso_duration(value: dt.timedelta) -> str:
    """An INTERVAL as ISO 8601 ``[-]PnDTnHnMnS``. DuckDB's Python client gives a ``timedelta`` in which a
    month is 30 days (``INTERVAL 1 MONTH`` → ``P30D``); cast to VARCHAR for DuckDB's own text."""
    us = value // dt.timedelta(microseconds=1)
    sign, us = ("-", -us) if us < 0 else ("", us)
    days, us = divmod(us, 86_400_000_000)
    hours, us = divmod(us, 3_600_000_000)
    minutes, us = divmod(us, 60_000_000)
    seconds, us = divmod(us, 1_000_000)
    time = "".join(f"{n}{unit}" for n, unit in ((hours, "H"), (minutes, "M")) if n)
    if seconds or us:
        time += f"{seconds}.{us:06d}".rstrip("0").rstrip(".") + "S"
    if not time and not days:
        return "PT0S"
    return f"{sign}P{f'{days}D' if days else ''}{'T' + time if time else ''}"


def json_value(value: Any) -> Any:
    """One value as JSON has it (docs/accounting.md, "Types"):

    - DATE, TIME, TIMETZ, TIMESTAMP, TIMESTAMPTZ: ISO 8601 text (``isoformat``; TIMESTAMPTZ in UTC, the
      session's time zone); values Python cannot hold arrive from DuckDB as its own text and stay so;
    - INTERVAL: ISO 8601 duration (:func:`iso_duration`); UUID: its text; BLOB (and GEOMETRY): hex;
    - DECIMAL: a number (float64: cast to VARCHAR for every digit); HUGEINT/UHUGEINT/BIGNUM: an integer;
    - DOUBLE/FLOAT NaN, Infinity, -Infinity: the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``;
    - LIST, ARRAY, tuple: a list; STRUCT: an object; MAP: an object with text keys, or DuckDB's own
      ``{"key": [...], "value": [...]}`` when its keys are not scalars; ENUM, BIT, VARCHAR: text.
    """
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return NON_FINITE.get(value, "NaN")
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return iso_duration(value)
    if isinstance(value, decimal.Decimal):
        return json_value(float(value))
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, list | tuple):
        return [json_value(v) for v in value]
    if isinstance(value, dict):
        return {_key(k): json_value(v) for k, v in value.items()}
    return str(value)


def _key(key: Any) -> str:
    converted = json_value(key)
    return converted if isinstance(converted, str) else _encoder.encode(converted).decode()


def json_row(row: Sequence[Any]) -> list[Any]:
    return [json_value(v) for v in row]


def encoded_size(value: Any) -> int:
    """Bytes ``value`` (already :func:`json_value`'d) takes in the JSON answer."""
    return len(_encoder.encode(value))


def encode(value: Any) -> bytes:
    return _encoder.encode(value)
