"""The admin link's JSON Structs (proto/admin.py) and the Cancel message: round trips, the wire as before."""

from __future__ import annotations

import msgspec
import pytest

from proto import (
    IDENTITY_ROWS,
    ApiKeyRow,
    AuthCheck,
    AuthReply,
    Cancel,
    ConfigChanged,
    CostsQuery,
    CostsReport,
    DayCosts,
    ErrorDetail,
    ErrorReply,
    KeyCosts,
    LimitsRow,
    MemberCosts,
    ModelCosts,
    ProtoDecodeError,
    SqlQuery,
    SqlReply,
    UserRow,
    WindowCosts,
    decode,
    decode_json,
    encode,
    encode_json,
)
from services.gateway.identity import REPLICATED

REPORT = CostsReport(
    generated_at="2026-11-02T12:00:00+00:00", days=2, rate_usd_per_kwh=0.125,
    today=DayCosts(day="2026-11-02", requests=3, output_tokens=9, kwh=0.5, methods=["counter"], coverage_pct=100.0),
    window=WindowCosts(from_day="2026-11-01", to_day="2026-11-02", requests=3, output_tokens=9, kwh=0.5),
    daily=[DayCosts(day="2026-11-01"), DayCosts(day="2026-11-02", requests=3, kwh=0.5)],
    by_model=[ModelCosts(model="m", requests=3)], by_member=[MemberCosts(member="w1", requests=3)],
    by_api_key=[KeyCosts(api_key_id=None, requests=3, j_per_output_token=1.5)], note="n")

JSON_EXAMPLES = [
    AuthCheck(key_sha256="ab" * 32),
    AuthReply(ok=True, role="admin", key_id="k1", user="ops"),
    AuthReply(ok=False),
    ConfigChanged(gateway_id="gw", config={"pools": [{"name": "p", "members": []}], "metrics": {"poll_interval": 2}}),
    SqlQuery(sql="SELECT 1"),
    SqlQuery(export_parquet=True),
    SqlReply(columns=["n", "day"], rows=[[1, "2026-11-02"], [None, None]]),
    SqlReply(files=["/x/a.parquet"]),
    SqlReply(error="only SELECT"),
    CostsQuery(days=7),
    ErrorReply(error=ErrorDetail(message="bad costs request: x", type="invalid_request_error", code="invalid_request")),
    REPORT,
    UserRow(user_id="u1", name="ops", role="admin", pw_hash="h", created_s=1.0, updated_s=2.0),
    ApiKeyRow(key_id="k1", user_id="u1", name="ci", key_sha256="ab" * 32, hint="sk-…abcd", daily_quota=None,
              created_s=1.0, expires_s=None, revoked_s=3.0, replaced_by="k2", updated_s=3.0),
    LimitsRow(principal="user-u1", tokens_per_day=1000, requests_per_minute=None, tokens_per_minute=None,
              usd_per_month=2.5, kwh_per_month=None, updated_s=4.0),
]


@pytest.mark.parametrize("message", JSON_EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_admin_struct_survives_a_json_round_trip(message: msgspec.Struct) -> None:
    assert decode_json(encode_json(message), type(message)) == message


def test_a_cancel_survives_a_msgpack_round_trip_and_garbage_is_a_decode_error() -> None:
    assert decode(encode(Cancel(request_id="r-1")), Cancel) == Cancel(request_id="r-1")
    with pytest.raises(ProtoDecodeError, match="Cancel"):
        decode(b"r-1", Cancel)  # the raw request id the previous version sent


def test_the_admin_replies_keep_the_wire_shapes_of_the_hand_built_dicts() -> None:
    assert msgspec.json.decode(encode_json(AuthReply(ok=False))) == {"ok": False}
    assert msgspec.json.decode(encode_json(AuthReply(ok=True, role="user", key_id="k", user="a"))) == {
        "ok": True, "role": "user", "key_id": "k", "user": "a"}
    assert msgspec.json.decode(encode_json(SqlReply(columns=["n"], rows=[]))) == {"columns": ["n"], "rows": []}
    assert msgspec.json.decode(encode_json(SqlReply(error="e"))) == {"error": "e"}
    assert decode_json(b'{"sql": "SELECT 1"}', SqlQuery) == SqlQuery(sql="SELECT 1")
    assert decode_json(b"{}", CostsQuery).days == 30
    assert msgspec.json.decode(encode_json(ErrorReply(error=ErrorDetail(message="m", type="t")))) == {
        "error": {"message": "m", "type": "t", "param": None, "code": None}}


def test_the_costs_report_writes_every_figure_and_unknown_is_null() -> None:
    doc = msgspec.json.decode(encode_json(REPORT))
    assert doc["window"]["from"] == "2026-11-01" and doc["window"]["to"] == "2026-11-02"
    assert doc["daily"][0] == {"day": "2026-11-01", "requests": None, "prompt_tokens": None, "cached_tokens": None,
                               "output_tokens": None, "kwh": None, "energy_usd": None, "estimated_kwh": None,
                               "list_value_usd": None, "j_per_output_token": None, "methods": [],
                               "coverage_pct": None}
    assert doc["by_api_key"][0]["api_key_id"] is None
    assert msgspec.to_builtins(REPORT) == doc


def test_a_renamed_costs_field_fails_at_decode_instead_of_blanking_the_page() -> None:
    doc = msgspec.json.decode(encode_json(REPORT))
    doc["today"]["when"] = doc["today"].pop("day")
    with pytest.raises(ProtoDecodeError, match="CostsReport"):
        decode_json(msgspec.json.encode(doc), CostsReport)


def test_malformed_json_is_told_apart_from_the_wrong_shape() -> None:
    with pytest.raises(ProtoDecodeError) as not_json:
        decode_json(b"not json", AuthCheck)
    assert not_json.value.is_malformed
    with pytest.raises(ProtoDecodeError) as wrong_shape:
        decode_json(b'{"sql": 5}', SqlQuery)
    assert not wrong_shape.value.is_malformed


def test_identity_rows_name_the_replicated_columns_in_order() -> None:
    assert {table: cls.__struct_fields__ for table, cls in IDENTITY_ROWS.items()} == REPLICATED


def test_identity_rows_written_by_the_previous_version_still_decode() -> None:
    # what identity_sync put into the llm_identity bucket before the Structs: msgspec.json.encode(row dict)
    user = (b'{"user_id":"u_1","name":"ops","role":"admin","pw_hash":"scrypt$x","created_s":1700000000,'
            b'"updated_s":1700000001.5}')
    key = (b'{"key_id":"k_1","user_id":"u_1","name":"ci","key_sha256":"' + b"ab" * 32 + b'","hint":"sk-...abcd",'
           b'"daily_quota":5000,"created_s":1700000000.0,"expires_s":null,"revoked_s":null,"replaced_by":null,'
           b'"updated_s":1700000002.0}')
    limits = (b'{"principal":"user-u_1","tokens_per_day":null,"requests_per_minute":60,"tokens_per_minute":null,'
              b'"usd_per_month":10,"kwh_per_month":0.5,"updated_s":1700000003.0}')
    assert decode_json(user, UserRow).created_s == 1700000000.0
    assert decode_json(key, ApiKeyRow).daily_quota == 5000
    row = msgspec.structs.asdict(decode_json(limits, LimitsRow))
    assert (row["requests_per_minute"], row["usd_per_month"], row["kwh_per_month"]) == (60, 10.0, 0.5)
    assert list(row) == list(REPLICATED["limits"])
