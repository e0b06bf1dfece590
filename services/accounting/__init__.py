"""Accounting: the only process that opens the DuckDB file.

Consumes the ``USAGE`` stream with a durable JetStream consumer, inserts one row per UsageRecord
(deduplicated by request id, acknowledged only after the commit), and answers read-only SQL on
``llm.v1.accounting.sql``.

Errors: :class:`store.QueryRejected` (a statement that is not one read-only SELECT) and
:class:`store.QueryFailed` (DuckDB refused it) are reported to the caller with their message.
"""
