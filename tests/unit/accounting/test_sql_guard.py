"""The function rule of operator SQL (services/accounting/sql_guard.py; docs/accounting.md, "Refused functions"),
on trees from DuckDB's own parser, and checked against this DuckDB's whole function list."""

from __future__ import annotations

import json

import duckdb
import pytest

from services.accounting import sql_guard
from services.accounting.store import QueryGuard


@pytest.fixture(scope="module")
def con() -> duckdb.DuckDBPyConnection:
    return duckdb.connect(":memory:")


@pytest.fixture(scope="module")
def guard(con: duckdb.DuckDBPyConnection) -> QueryGuard:
    return QueryGuard.of(con)


def refusal(con: duckdb.DuckDBPyConnection, guard: QueryGuard, sql: str) -> str | None:
    (text,) = con.execute("SELECT json_serialize_sql($1)", [sql]).fetchone() or ("{}",)
    return sql_guard.refusal(json.loads(text), guard.table_functions, guard.denied)


@pytest.mark.parametrize("sql", [
    "SELECT * FROM checkpoint()",
    "SELECT * FROM force_checkpoint()",
    "SELECT * FROM main.checkpoint()",
    "SELECT * FROM CHECKPOINT()",
    "SELECT 1 WHERE 1 IN (SELECT 1 FROM checkpoint())",
    "WITH c AS (SELECT * FROM checkpoint()) SELECT 1",
    "SELECT (SELECT count(*) FROM force_checkpoint())",
    "SELECT * FROM range(1) r, LATERAL (SELECT * FROM checkpoint())",
    "SELECT 1 UNION ALL SELECT 1 FROM checkpoint()",
    "SELECT * FROM query('SELECT 1')",
    "SELECT * FROM query_table('requests')",
    "SELECT * FROM json_execute_serialized_sql('{}')",
    "SELECT * FROM enable_logging()",
    "SELECT * FROM truncate_duckdb_logs()",
    "SELECT * FROM duckdb_secrets()",
    "SELECT * FROM duckdb_logs",  # a table function written as a table
    "SELECT * FROM read_csv('/etc/passwd')",
    "SELECT nextval('s')",
    "SELECT setval('s', 1)",
    "SELECT setseed(0.5)",
    "SELECT sleep_ms(100000)",
    "SELECT write_log('x')",
    "SELECT ('s').nextval()",
    "SELECT max(nextval('s')) OVER ()",
])
def test_functions_that_write_run_other_sql_or_change_state_are_refused(
        con: duckdb.DuckDBPyConnection, guard: QueryGuard, sql: str) -> None:
    reason = refusal(con, guard, sql)
    assert reason is not None and "not allowed" in reason, (sql, reason)


@pytest.mark.parametrize("sql", [
    "SELECT 1",
    "SELECT * FROM range(3)",
    "SELECT * FROM generate_series(1, 3), unnest([1, 2])",
    "SELECT random(), uuid(), gen_random_uuid(), now(), current_date",
    "SELECT table_name FROM duckdb_tables() UNION ALL SELECT table_name FROM duckdb_tables",
    "SELECT * FROM pragma_table_info('x')",
    "SELECT count(*) FILTER (WHERE x > 1) OVER () FROM (VALUES (1), (2)) v(x)",
    "SELECT function_name FROM duckdb_functions()",
    "SELECT [x * 2 FOR x IN [1, 2]], list_sum([1, 2]), 1 + 2",
    "WITH t AS (SELECT 1 AS a) SELECT a FROM t",
])
def test_ordinary_queries_and_catalog_reads_pass(con: duckdb.DuckDBPyConnection, guard: QueryGuard, sql: str) -> None:
    assert refusal(con, guard, sql) is None


def test_every_table_function_of_this_duckdb_is_allowed_only_if_listed(
        con: duckdb.DuckDBPyConnection, guard: QueryGuard) -> None:
    # An allow-list: a table function a newer DuckDB adds is refused until someone reads it and lists it.
    names = {n for (n,) in con.execute("SELECT DISTINCT lower(function_name) FROM duckdb_functions() "
                                       "WHERE function_type IN ('table', 'table_macro')").fetchall()}
    assert {"checkpoint", "force_checkpoint", "query", "duckdb_secrets"} <= names
    for name in sorted(names):
        reason = refusal(con, guard, f'SELECT * FROM "{name}"()')
        if name in sql_guard.ALLOWED_TABLE_FUNCTIONS:
            assert reason is None, name
        else:
            assert reason is not None and name in reason, name
    fresh = sql_guard.refusal(json.loads(con.execute(
        "SELECT json_serialize_sql('SELECT * FROM some_future_function()')").fetchone()[0]),  # type: ignore[index]
        guard.table_functions, guard.denied)
    assert fresh is not None and "some_future_function" in fresh


def test_every_function_duckdb_marks_as_having_side_effects_is_refused_unless_listed_harmless(
        guard: QueryGuard, con: duckdb.DuckDBPyConnection) -> None:
    marked = {n for (n,) in con.execute("SELECT DISTINCT lower(function_name) FROM duckdb_functions() "
                                        "WHERE has_side_effects AND function_type NOT IN ('table', 'table_macro')"
                                        ).fetchall()}
    assert "nextval" in marked
    assert guard.denied == (marked - sql_guard.HARMLESS_SIDE_EFFECT_FUNCTIONS) | sql_guard.DENIED_FUNCTIONS
    # a function a newer catalog marks as having side effects is refused without a change here
    assert "frobnicate" in sql_guard.denied_functions(frozenset({"frobnicate"}))


def test_a_tree_the_parser_could_not_make_is_refused_not_passed() -> None:
    reason = sql_guard.refusal({"error": True, "error_message": "not implemented"}, frozenset(), frozenset())
    assert reason is not None and "cannot check" in reason
    assert sql_guard.refusal({}, frozenset(), frozenset()) is not None
