"""Which functions an operator's SELECT may call: the rule over DuckDB's parse tree. Pure: no DuckDB, no I/O.

Why a rule over functions: a SELECT can still write. ``SELECT * FROM checkpoint()`` checkpoints the file
even inside ``BEGIN TRANSACTION READ ONLY`` (measured on DuckDB 2.0.1), ``query('…')`` and
``json_execute_serialized_sql`` run SQL text the statement check never saw, ``enable_logging()`` and
``truncate_duckdb_logs()`` change the database's state, ``nextval``/``setval`` move sequences,
``sleep_ms`` holds a reader without doing work. The store parses the query with DuckDB's own parser
(``json_serialize_sql``) and hands the tree to :func:`refusal`.

The rule cannot be widened silently by a newer DuckDB:

- **table functions: an allow-list** (:data:`ALLOWED_TABLE_FUNCTIONS`). Any other, including every one a
  newer DuckDB adds, is refused until someone reads it and adds it here. A table function named as if
  it were a table (``FROM duckdb_tables`` works without parentheses) is checked the same way.
- **scalar, aggregate and window functions: a deny rule from DuckDB's catalog.** Every function that
  ``duckdb_functions()`` marks ``has_side_effects`` is refused unless it is in
  :data:`HARMLESS_SIDE_EFFECT_FUNCTIONS` (random values, the current query's ids); :data:`DENIED_FUNCTIONS`
  are refused even if a later catalog stopped marking them.

The guard is the second layer, not the only one: the query also runs inside a read-only transaction on
a database without external access and with its configuration locked (store.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

ALLOWED_TABLE_FUNCTIONS = frozenset({
    # generators and list expansion
    "range", "generate_series", "unnest", "repeat", "repeat_row",
    # the catalog, read-only
    "duckdb_columns", "duckdb_constraints", "duckdb_databases", "duckdb_dependencies", "duckdb_functions",
    "duckdb_indexes", "duckdb_keywords", "duckdb_schemas", "duckdb_sequences", "duckdb_tables",
    "duckdb_types", "duckdb_views", "duckdb_settings", "duckdb_memory", "duckdb_optimizers",
    "duckdb_temporary_files",
    "pragma_table_info", "pragma_database_size", "pragma_storage_info", "pragma_metadata_info",
    "pragma_version", "pragma_platform", "pragma_collations", "pragma_show", "pragma_user_agent",
    "pg_timezone_names", "icu_calendar_names", "test_all_types", "summary",
    # JSON values in a column
    "json_each", "json_tree",
})
"""Table functions an operator query may call. Not here, on purpose: ``checkpoint``/``force_checkpoint``
(write the file), ``query``/``query_table``/``json_execute_serialized_sql`` (run SQL text unseen),
``enable_*``/``disable_*``/``truncate_duckdb_logs``/``*_external_resource*``/``*_grammar_extension``
(change state), ``duckdb_secrets``/``which_secret`` (secrets), ``read_*``/``glob``/``sniff_csv``/
``parquet_*`` (files: refused by the database as well), ``*_scan``/``python_map_function`` (the host's
Python objects), ``duckdb_logs``/``duckdb_prepared_statements`` (other sessions' text)."""

HARMLESS_SIDE_EFFECT_FUNCTIONS = frozenset({
    "random", "uuid", "uuidv4", "uuidv7", "gen_random_uuid", "current_query", "current_query_id",
    "current_connection_id", "current_transaction_id", "error", "vector_type", "stats",
})
"""Functions DuckDB marks ``has_side_effects`` that only read or make up a value."""

DENIED_FUNCTIONS = frozenset({"nextval", "setval", "currval", "setseed", "sleep_ms", "write_log"})
"""Refused whatever the catalog says (moving a sequence or the random seed, sleeping, writing the log)."""


def denied_functions(side_effect_functions: frozenset[str]) -> frozenset[str]:
    """The scalar/aggregate/window names refused, given the catalog's ``has_side_effects`` names."""
    return (frozenset(n.lower() for n in side_effect_functions) - HARMLESS_SIDE_EFFECT_FUNCTIONS) | DENIED_FUNCTIONS


def refusal(tree: Mapping[str, Any], table_functions: frozenset[str], denied: frozenset[str]) -> str | None:
    """Why the parsed statement ``tree`` (``json_serialize_sql``'s output) may not run, or None.

    ``table_functions``: every table function and table macro name the database knows (lower case), so
    that ``FROM name`` without parentheses is recognised as a call; ``denied``: :func:`denied_functions`."""
    if tree.get("error") is not False:
        return f"cannot check this query: {tree.get('error_message') or 'the parser gave no tree'}"
    for kind, name in _calls(tree):
        if kind == "table" and name not in ALLOWED_TABLE_FUNCTIONS:
            return (f"the table function {name}() is not allowed in operator queries "
                    "(it writes, runs other SQL, changes settings or reads outside the ledger)")
        if kind == "table_ref" and name in table_functions and name not in ALLOWED_TABLE_FUNCTIONS:
            return f"the table function {name} is not allowed in operator queries"
        if kind == "function" and name in denied:
            return f"the function {name}() is not allowed in operator queries (it has side effects)"
    return None


def _calls(node: Any) -> Iterator[tuple[str, str]]:
    """Every (kind, lower-case name) call in a parse tree: ``table`` for a table-function call in FROM,
    ``table_ref`` for a plain name in FROM, ``function`` for any other function call."""
    if isinstance(node, list):
        for item in node:
            yield from _calls(item)
        return
    if not isinstance(node, Mapping):
        return
    kind = node.get("type")
    if kind == "TABLE_FUNCTION" and isinstance(node.get("function"), Mapping):
        yield "table", str(node["function"].get("function_name", "")).lower()
    elif kind == "BASE_TABLE":
        yield "table_ref", str(node.get("table_name", "")).lower()
    elif node.get("class") in ("FUNCTION", "WINDOW") and "function_name" in node:
        yield "function", str(node["function_name"]).lower()
    for value in node.values():
        yield from _calls(value)
