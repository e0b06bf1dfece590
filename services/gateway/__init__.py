"""Gateway: the OpenAI-compatible front door.

Keeps the newest SlotHeartbeat per worker (bus subscription + the ``llm_workers`` KV bucket at
start), routes each request to the best member of its pool with the pure functions in :mod:`routing`, streams the
engine's TokenChunks back as OpenAI responses or SSE, and publishes one UsageRecord per request to
the ``USAGE`` stream.

Errors: handlers raise :class:`services.common.http.HTTPError`; the error middleware writes the one
OpenAI error body. :class:`openai_api.InvalidRequest` is a 400 with the offending ``param``. A member
that did not take a request raises a :class:`services.gateway.errors.MemberFailure` (the tree is drawn in
:mod:`services.gateway.errors`); the failover loop catches the base class and tries the next member.
"""
