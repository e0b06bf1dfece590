"""The Limits page's form and JSON body ↔ limits (services/gateway/limits_form.py), and how spend reads."""

from __future__ import annotations

from typing import Any

import pytest

from services.gateway import limits_form
from services.gateway.identity import IdentityError
from services.gateway.limits import Limits


def test_a_form_changes_only_the_kinds_it_carries_and_an_empty_field_clears_one() -> None:
    values, errors = limits_form.from_form({"csrf": "x", "requests_per_minute": "1,200", "usd_per_month": "",
                                            "kwh_per_month": "none"})
    assert values == {"requests_per_minute": 1_200, "usd_per_month": None, "kwh_per_month": None}
    assert errors == {}


def test_a_form_names_every_field_it_cannot_read() -> None:
    values, errors = limits_form.from_form({"tokens_per_day": "1.5", "requests_per_minute": "0",
                                            "tokens_per_minute": "100", "kwh_per_month": "nan"})
    assert values == {"tokens_per_minute": 100}
    assert set(errors) == {"tokens_per_day", "requests_per_minute", "kwh_per_month"}
    assert "positive" in errors["requests_per_minute"]


@pytest.mark.parametrize(("body", "changes"), [
    ({"user": "a", "requests_per_minute": 60}, {"requests_per_minute": 60}),
    ({"user": "a", "requests_per_minute": 60.0}, {"requests_per_minute": 60}),  # a float that is whole: fine
    ({"key_id": "key_1", "usd_per_month": 2, "kwh_per_month": None}, {"usd_per_month": 2, "kwh_per_month": None}),
    ({"user": "a"}, {}),
])
def test_a_json_body_sets_the_kinds_it_names_and_null_clears(body: dict[str, Any], changes: dict[str, Any]) -> None:
    assert limits_form.changes_from_json(body) == changes
    assert isinstance(limits_form.changes_from_json(body).get("requests_per_minute", 0), int)


@pytest.mark.parametrize(("body", "param"), [
    ({"user": "a", "requests_per_minute": 1.5}, "requests_per_minute"),
    ({"user": "a", "tokens_per_day": 0}, "tokens_per_day"),
    ({"user": "a", "usd_per_month": "5"}, "usd_per_month"),  # numbers are numbers in JSON
    ({"user": "a", "kwh_per_month": True}, "kwh_per_month"),
    ({"user": "a", "tokens_per_minute": 10**13}, "tokens_per_minute"),
    ({"user": "a", "rpm": 5}, "rpm"),  # a typo is refused, not ignored
])
def test_a_bad_json_value_is_refused_naming_its_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(IdentityError) as info:
        limits_form.changes_from_json(body)
    assert info.value.field == param


@pytest.mark.parametrize(("body", "param"), [({}, "user"), ({"user": "a", "key_id": "key_1"}, "user"),
                                             ({"user": 5}, "user"), ({"key_id": ""}, "key_id")])
def test_a_json_body_names_exactly_one_user_or_key(body: dict[str, Any], param: str) -> None:
    with pytest.raises(IdentityError) as info:
        limits_form.target_from_json(body)
    assert info.value.field == param


@pytest.mark.parametrize(("kind", "spent", "limit", "age_s", "text"), [
    ("tokens_per_day", 1234.0, 50_000, None, "1,234 / 50,000 tokens today"),
    ("requests_per_minute", 3.0, None, None, "3 requests this minute, no limit"),
    ("tokens_per_minute", 0.0, 4000, None, "0 / 4,000 tokens this minute"),
    ("usd_per_month", 1.23456, 20.0, None, "1.2346 / 20 USD this month"),
    ("kwh_per_month", None, 5.0, None, "not reported yet"),
    ("kwh_per_month", 0.5, 5.0, 4 * 60.0, "0.5000 / 5 kWh this month (ledger: 4 min ago)"),
])
def test_spend_reads_as_counted_over_limit_with_its_window(kind: str, spent: float | None, limit: float | None,
                                                           age_s: float | None, text: str) -> None:
    assert limits_form.spend_text(kind, spent, limit, age_s) == text


def test_a_rows_cells_keep_what_a_refused_form_sent() -> None:
    cells = limits_form.cells(Limits(requests_per_minute=60, usd_per_month=2.5), {"requests_per_minute": 7.0},
                              None, texts={"tokens_per_day": "1.5"}, errors={"tokens_per_day": "whole number"})
    by_kind = {c["kind"]: c for c in cells}
    assert [c["kind"] for c in cells] == ["tokens_per_day", "requests_per_minute", "tokens_per_minute",
                                          "usd_per_month", "kwh_per_month"]
    assert (by_kind["tokens_per_day"]["text"], by_kind["tokens_per_day"]["error"]) == ("1.5", "whole number")
    assert (by_kind["requests_per_minute"]["text"], by_kind["usd_per_month"]["text"]) == ("60", "2.5")
    assert by_kind["requests_per_minute"]["spend"] == "7 / 60 requests this minute"
    assert by_kind["kwh_per_month"]["spend"] == "not reported yet"
