"""Accounting: the only process that opens the DuckDB file (docs/accounting.md).

Consumes the ``USAGE`` and ``ENERGY`` streams with durable JetStream consumers (one transaction per
batch, acknowledged after the commit, deduplicated by message identity), derives energy intervals and
their attribution to requests, keeps hourly/daily rollups, and answers read-only SQL and the costs
document on the bus and on an admin HTTP server.

Errors: :class:`store.QueryRejected` (not one read-only SELECT, or too long), :class:`store.QueryFailed`
(DuckDB refused it, e.g. a file reader) and :class:`service.QueryTimedOut` (interrupted after the time
limit) are reported to the caller with their message; HTTP maps them to 400/400/408.
"""
