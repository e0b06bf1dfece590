"""``llmgw admin``: manage the gateway's users from a shell on the gateway host.

    llmgw admin create-user NAME [--role admin|user] [--password-stdin] [--data-dir DIR]
    llmgw admin reset-password NAME [--password-stdin] [--data-dir DIR]
    llmgw admin list-users [--data-dir DIR]

Works on the identity database in the gateway's data dir (SQLite: safe while the gateway runs). The
password is asked for twice on a terminal (never taken as an argument, so it stays out of shell history
and ``ps``), or read from stdin with ``--password-stdin``.
"""

from __future__ import annotations

import argparse
import getpass
import sys

from services.common.runtime import data_dir
from services.gateway.identity import (
    ROLES,
    IdentityError,
    IdentityStore,
    check_password_rules,
    check_user_name,
    hash_password,
)


def _read_password(from_stdin: bool) -> str:
    if from_stdin:
        return sys.stdin.readline().rstrip("\n")
    first = getpass.getpass("Password (10+ characters): ")
    if getpass.getpass("Again: ") != first:
        raise IdentityError("password", "the two passwords differ")
    return first


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmgw admin", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    create = sub.add_parser("create-user", help="add a user")
    create.add_argument("name")
    create.add_argument("--role", choices=ROLES, default="user")
    reset = sub.add_parser("reset-password", help="set a user's password and end their sessions")
    reset.add_argument("name")
    for p in (create, reset):
        p.add_argument("--password-stdin", action="store_true", help="read the password from stdin")
    listing = sub.add_parser("list-users", help="list users and roles")
    for p in (create, reset, listing):
        p.add_argument("--data-dir", help="the gateway's data directory (default: $LLMGW_DATA_DIR or ./data)")
    args = parser.parse_args(argv)
    store = IdentityStore(data_dir(args.data_dir) / "identity")
    try:
        if args.command == "list-users":
            for user in store.users():
                print(f"{user.name}\t{user.role}")
            return
        check_user_name(args.name)
        if args.command == "reset-password" and store.password_hash(args.name) is None:
            raise IdentityError("name", f"no user named {args.name!r}")
        password = _read_password(args.password_stdin)
        check_password_rules(password)
        if args.command == "create-user":
            store.create_user(args.name, hash_password(password), args.role)
            print(f"created {args.role} {args.name!r}; sign in at the gateway's /")
        else:
            found = store.password_hash(args.name)
            assert found is not None
            store.set_password(found[0].user_id, hash_password(password))
            store.end_sessions_of(found[0].user_id)
            print(f"password of {args.name!r} changed; their sessions were ended")
    except IdentityError as exc:
        print(f"llmgw admin: {exc.field}: {exc.message}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        store.close()


if __name__ == "__main__":
    main()
