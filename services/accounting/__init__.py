"""Accounting: the only process that opens the DuckDB file (docs/accounting.md).

Consumes the ``USAGE`` and ``ENERGY`` streams with durable JetStream consumers (one transaction per
batch, acknowledged after the commit, deduplicated by message identity), derives energy intervals and
their attribution to requests, keeps hourly/daily rollups, and answers read-only SQL and the costs
document on the bus and on an admin HTTP server.

Errors of operator SQL, reported to the caller with their message (HTTP status and code in brackets):
:class:`store.QueryRejected` (not one read-only SELECT, too long, or a refused function: 400
``query_rejected``), :class:`store.QueryFailed` (DuckDB refused it, e.g. a file reader: 400
``query_failed``), :class:`sql_runner.ResultTooLarge` (over the row or byte cap: 400 ``result_too_large``),
:class:`sql_runner.QueryTimedOut` (interrupted at the time limit from the start of execution: 408
``query_timeout``) and :class:`sql_runner.QueryBusy` (the queue is full: 503 ``sql_busy``, Retry-After).
"""
