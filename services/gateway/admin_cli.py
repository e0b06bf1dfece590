"""``llmgw admin``: manage the gateway's users from a shell on the gateway host.

    llmgw admin create-user NAME [--role admin|user] [--password-stdin] [--data-dir DIR]
    llmgw admin reset-password NAME [--password-stdin] [--data-dir DIR]
    llmgw admin list-users [--data-dir DIR]
    llmgw admin list-keys [--user NAME] [--data-dir DIR]
    llmgw admin set-quota KEY_ID N|none [--data-dir DIR]

Works on the identity database in the gateway's data dir (SQLite: safe while the gateway runs). The
password is asked for twice on a terminal (never taken as an argument, so it stays out of shell history
and ``ps``), or read from stdin with ``--password-stdin``.

Users and passwords changed here count at once, also for a running gateway. Keys are different: a
running gateway keeps its keys in memory and rereads the file every 15 s, so a quota set here applies
within 15 s; the Users page (``/admin/users``) applies one at once.
"""

from __future__ import annotations

import argparse
import getpass
import sys
import time

from services.common.runtime import data_dir
from services.gateway.identity import (
    ROLES,
    IdentityError,
    IdentityStore,
    check_password_rules,
    check_user_name,
    hash_password,
    parse_daily_quota,
)


def _read_password(from_stdin: bool) -> str:
    if from_stdin:
        return sys.stdin.readline().rstrip("\n")
    first = getpass.getpass("Password (10+ characters): ")
    if getpass.getpass("Again: ") != first:
        raise IdentityError("password", "the two passwords differ")
    return first


def _quota(text: str) -> int | None:
    """``N`` tokens per UTC day (the Users page's rules), or ``none`` for no quota."""
    if text.strip().lower() == "none":
        return None
    try:
        quota = parse_daily_quota(text)
    except IdentityError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc.message}") from None
    if quota is None:
        raise argparse.ArgumentTypeError("give a number of tokens, or 'none' for no quota")
    return quota


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
    keys = sub.add_parser("list-keys", help="list API keys: id, user, name, hint, daily quota, status")
    keys.add_argument("--user", help="only this user's keys")
    quota = sub.add_parser("set-quota", help="set a key's daily token quota (prompt + output tokens per UTC day)")
    quota.add_argument("key_id", help="the key's id (key_…, see list-keys)")
    quota.add_argument("quota", type=_quota, metavar="N|none", help="tokens per UTC day, or 'none' for no quota")
    for p in (create, reset, listing, keys, quota):
        p.add_argument("--data-dir", help="the gateway's data directory (default: $LLMGW_DATA_DIR or ./data)")
    args = parser.parse_args(argv)
    store = IdentityStore(data_dir(args.data_dir) / "identity")
    try:
        if args.command == "list-users":
            for user in store.users():
                print(f"{user.name}\t{user.role}")
            return
        if args.command == "list-keys":
            names = {u.user_id: u.name for u in store.users()}
            if args.user is not None and args.user not in names.values():
                raise IdentityError("user", f"no user named {args.user!r}")
            now = time.time()
            for key in store.keys_of(None):
                if args.user is None or names.get(key.user_id) == args.user:
                    quota = "none" if key.daily_quota is None else str(key.daily_quota)
                    print(f"{key.key_id}\t{names.get(key.user_id, '?')}\t{key.name}\t{key.hint}\t{quota}\t"
                          f"{key.status(now)}")
            return
        if args.command == "set-quota":
            if store.key_by_id(args.key_id) is None:
                raise IdentityError("key_id", f"no key with id {args.key_id!r} (see llmgw admin list-keys)")
            store.set_quota(args.key_id, args.quota)
            shown = "none" if args.quota is None else f"{args.quota:,} tokens per UTC day"
            print(f"daily quota of {args.key_id} set to {shown}; a running gateway applies it within 15 s "
                  "(the Users page applies it at once)")
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
