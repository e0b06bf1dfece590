"""The composition root: the ``llmgw`` command line and the ``llmgw up`` supervisor.

This is the one package that knows every service: ``cli.py`` dispatches each role to that service's
``__main__``, and ``stack.py`` starts them all (with an embedded nats-server) as child processes. It sits
above every service, so it may import any of them; no service, and nothing in ``services/common``, may
import it.

Errors: :class:`stack.StackError` (a child that exits during start-up, or keeps exiting) ends ``llmgw up``
with one line naming the child (exit 2).
"""
