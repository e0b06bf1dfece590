"""The accounting service's HTTP API as an OpenAPI 3.1 document (served at ``/openapi.json``).

``/sql`` and ``/costs`` take an admin's API key, checked by the gateways over the bus (503 when none
answers); ``/sql`` answers 408 when a query runs past its limit and 503 when the SQL queue is full.
A test holds it to the routes the app serves; tests/faults/test_openapi_fuzz.py fuzzes it."""

from __future__ import annotations

from typing import Any

from services.common.openapi_spec import document as build
from services.common.openapi_spec import get, post

_SQL = {"type": "object", "required": ["sql"], "properties": {"sql": {"type": "string"}}}
_DAYS = [{"name": "days", "in": "query", "required": False,
          "schema": {"type": "integer", "minimum": 1, "maximum": 366}}]


def document() -> dict[str, Any]:
    return build("llmgw accounting", {
        "/sql": post("A read-only SQL query over the ledger (docs/accounting.md)", _SQL,
                     ("400", "401", "403", "408", "413", "503")),
        "/costs": get("Tokens, kWh and $ per day, model, member and key over the last `days`",
                      ("400", "401", "403", "503"), _DAYS),
        "/health": get("Liveness", ()),
        "/openapi.json": get("This document", ()),
    }, "An admin's API key (sk-…), checked by the gateways")
