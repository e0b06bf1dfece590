"""The gateway's exception tree for a member that did not take a request (nothing reached the client yet).

::

    MemberFailure              a member did not take the request: the forwarder tries the next one
    ├── WorkerUnavailable      bus: no responder, silence before chunk 0, an error chunk, the bus is down
    └── MemberUnavailable      HTTP: connect error, 5xx/408, no headers within the first-byte deadline, 429

The forwarder (:mod:`services.gateway.forwarder`) catches the base class and reads its fields, never
the type: ``error`` is the member's own answer when it refused for a reason the client may be told
(a 400/413 about the request is re-raised at once; a 429 is kept and reported if no member accepts);
``is_bus_down`` says our own bus connection failed, which is not held against the member. A member
that refused the gateway's own key (401/403) carries an ``error`` with code :data:`CREDENTIALS_REJECTED`
(a 502 naming the member): it is down like a 5xx, and that error is the answer if no member accepts.
Everything the client is answered with is :class:`services.common.http.HTTPError`.
"""

from __future__ import annotations

from services.common.http import HTTPError

CREDENTIALS_REJECTED = "member_credentials_rejected"  # the code of the 502 for a member's 401/403


class MemberFailure(Exception):
    """A member did not take the request (nothing reached the client): try the next one."""

    def __init__(self, member_id: str, reason: str, error: HTTPError | None = None, is_bus_down: bool = False
                 ) -> None:
        super().__init__(f"{member_id}: {reason}")
        self.member_id = member_id
        self.reason = reason
        self.error = error  # the member's refusal the client may be told (429, 400, ...); None: just unavailable
        self.is_bus_down = is_bus_down  # our own connection is down: not the member's fault


class WorkerUnavailable(MemberFailure):
    """The worker did not accept the request (no responder, silence, or an error before any token)."""

    def __init__(self, worker_id: str, reason: str, error: HTTPError | None = None, is_bus_down: bool = False) -> None:
        super().__init__(worker_id, reason, error, is_bus_down)
        self.worker_id = worker_id


class MemberUnavailable(MemberFailure):
    """The HTTP member did not take the request (nothing reached the client): try the next one.

    ``error`` is set when the member refused for load (429): the client gets it if no member accepts.
    """

    def __init__(self, member_id: str, reason: str, status: int | None = None, error: HTTPError | None = None
                 ) -> None:
        super().__init__(member_id, reason, error)
        self.status = status
