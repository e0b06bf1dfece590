"""``llmgw``: one command line for every role.

    llmgw up           the whole stack on this machine (embedded NATS, engine, telemetry, accounting, gateway)
    llmgw gateway      the OpenAI-compatible front door
    llmgw engine       an inference engine worker on the bus
    llmgw telemetry    scrapes HTTP-only engines onto the bus
    llmgw accounting   usage and energy ledger (DuckDB)
    llmgw sql "SELECT …"   read-only SQL over the ledger
    llmgw admin create-user NAME [--role admin|user]   add a user to the gateway (asks for a password)
    llmgw bus-permissions [--engine ID ...]   a NATS permissions.conf: one user per role (and per named engine)
"""

from __future__ import annotations

import importlib
import sys

ROLES = {
    "up": "services.cli.stack",
    "gateway": "services.gateway.__main__",
    "engine": "services.engine.__main__",
    "telemetry": "services.telemetry.__main__",
    "accounting": "services.accounting.__main__",
    "sql": "services.accounting.sql_client",
    "admin": "services.gateway.admin_cli",
    "bus-permissions": "services.common.nats_auth",
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in ROLES:
        print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nllmgw: unknown command {argv[0]!r}", file=sys.stderr)
            raise SystemExit(2)
        return
    role, rest = argv[0], argv[1:]
    importlib.import_module(ROLES[role]).main(rest)


if __name__ == "__main__":
    main()
