"""``llmgw sql`` output: the table and JSON formats, NULL shown as NULL / null (docs/accounting.md, "SQL")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.accounting import sql_client
from services.accounting.store import Ledger


def test_format_table_pads_columns_shows_null_and_counts_rows() -> None:
    text = sql_client.format_table(["model", "kwh"], [["qwen3", 1.5], ["m", None]])
    assert text.splitlines() == [
        "model | kwh ",
        "------+-----",
        "qwen3 | 1.5 ",
        "m     | NULL",
        "(2 rows)",
    ]
    assert sql_client.format_table(["n"], [[7]]).splitlines()[-1] == "(1 row)"
    assert sql_client.format_table(["n"], []).splitlines() == ["n", "-", "(0 rows)"]


@pytest.fixture
def ledger_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ledger file and no running stack (no NATS URL anywhere): ``llmgw sql`` reads the file."""
    monkeypatch.delenv("NATS_URL", raising=False)
    db = tmp_path / "accounting.duckdb"
    Ledger(db).close()
    return db


def run_sql(db: Path, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    sql_client.main([*args, "--db", str(db), "--data-dir", str(db.parent)])
    return capsys.readouterr().out


def test_json_output_is_one_object_per_row_with_null_for_sql_null(ledger_file: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = run_sql(ledger_file, capsys, "SELECT 1 AS n, NULL AS kwh, 'x' AS model, TIMESTAMPTZ '2026-01-02 03:04:05+00' "
                                       "AS ts UNION ALL SELECT 2, 0.5, NULL, NULL ORDER BY n", "--format", "json")
    # the values the service sends over the bus: a DECIMAL literal is a number, a timestamp ISO 8601
    assert json.loads(out) == [{"n": 1, "kwh": None, "model": "x", "ts": "2026-01-02T03:04:05+00:00"},
                               {"n": 2, "kwh": 0.5, "model": None, "ts": None}]


def test_table_output_of_a_query_on_the_file_shows_null(ledger_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_sql(ledger_file, capsys, "SELECT count(*) AS n, max(request_id) AS newest FROM requests")
    assert out.splitlines() == ["n | newest", "--+-------", "0 | NULL  ", "(1 row)"]
