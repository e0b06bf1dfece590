"""``llmgw admin``: manage the gateway's users, keys and limits from a shell on the gateway host.

    llmgw admin create-user NAME [--role admin|user] [--password-stdin] [--data-dir DIR]
    llmgw admin reset-password NAME [--password-stdin] [--data-dir DIR]
    llmgw admin list-users [--data-dir DIR]
    llmgw admin list-keys [--user NAME] [--data-dir DIR]
    llmgw admin set-quota KEY_ID N|none [--data-dir DIR]
    llmgw admin set-limits (--user NAME | --key KEY_ID) [--tokens-per-day N|none] [--requests-per-minute N|none]
                           [--tokens-per-minute N|none] [--usd-per-month X|none] [--kwh-per-month X|none]
                           [--data-dir DIR]
    llmgw admin limits [--data-dir DIR]

Works on the identity database in the gateway's data dir (SQLite: safe while the gateway runs). The
password is asked for twice on a terminal (never taken as an argument, so it stays out of shell history
and ``ps``), or read from stdin with ``--password-stdin``.

``set-limits`` changes only the limits whose flags it is given (``none`` removes one); a key's tokens per
day is its daily quota (as ``set-quota``), its other limits bind the key's lineage (the key and the keys
rotated from it). ``limits`` prints every user's and every usable key's limits, tab-separated under a
header line. The kinds, windows and how they count: docs/admin.md, "Limits".

Users and passwords changed here count at once, also for a running gateway. Keys and limits are different:
a running gateway keeps them in memory and rereads the file every 15 s, so a quota or limit set here
applies within 15 s; the Users and Limits pages (``/admin/users``, ``/admin/limits``) apply one at once.
"""

from __future__ import annotations

import argparse
import getpass
import sys
import time
from collections.abc import Callable

from services.common.runtime import data_dir
from services.gateway.identity import (
    ROLES,
    IdentityError,
    IdentityStore,
    check_password_rules,
    check_user_name,
    hash_password,
    parse_daily_quota,
    parse_limit,
)
from services.gateway.limits import KINDS, UNITS, key_principal, user_principal

# How soon a change made here counts: the gateway rereads the file every identity_sync.RESYNC_S.
APPLIES = "a running gateway applies the change within 15 s (the Users and Limits pages apply one at once)"


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


def _limit(kind: str) -> Callable[[str], int | float | None]:
    """An argparse type for one limit flag: the Limits page's rules, ``none`` for no limit."""
    def parse(text: str) -> int | float | None:
        try:
            return parse_limit(kind, text)
        except IdentityError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc.message}") from None
    return parse


def _shown(value: float | None) -> str:
    return "none" if value is None else str(value) if isinstance(value, int) else f"{value:.12g}"


def _set_limits(store: IdentityStore, args: argparse.Namespace) -> None:
    """Only the kinds given on the command line change (argparse leaves the others out of ``args``)."""
    changes: dict[str, int | float | None] = {kind: getattr(args, kind) for kind in KINDS if hasattr(args, kind)}
    if not changes:
        flags = ", ".join("--" + kind.replace("_", "-") for kind in KINDS)
        raise IdentityError("set-limits", f"give at least one of {flags}")
    if args.user is not None:
        user = next((u for u in store.users() if u.name == args.user), None)
        if user is None:
            raise IdentityError("--user", f"no user named {args.user!r} (see llmgw admin list-users)")
        what = f"user {args.user!r}"
        limits = store.change_limits(user_principal(user.user_id), changes)
    else:
        if store.key_by_id(args.key) is None:
            raise IdentityError("--key", f"no key with id {args.key!r} (see llmgw admin list-keys)")
        what = f"key {args.key}"
        limits = store.change_key_limits(args.key, changes)
    shown = ", ".join(f"{kind} {_shown(getattr(limits, kind))}" for kind in KINDS)
    print(f"limits of {what}: {shown}; {APPLIES}")


def _print_limits(store: IdentityStore) -> None:
    """A header, then one line per user and per usable key: principal, user, key id, the five limits."""
    print("\t".join(("principal", "user", "key_id", *KINDS)))
    users = store.users()
    names = {u.user_id: u.name for u in users}
    for user in users:
        limits = store.limits_of(user_principal(user.user_id))
        print("\t".join((user_principal(user.user_id), user.name, "-", *(_shown(getattr(limits, k)) for k in KINDS))))
    now = time.time()
    keys = sorted((k for k in store.keys_of(None) if k.is_valid(now)),
                  key=lambda k: (names.get(k.user_id, ""), k.name, k.key_id))
    for key in keys:
        limits = store.key_limits(key)
        print("\t".join((key_principal(key.lineage or key.key_id), names.get(key.user_id, "?"), key.key_id,
                         *(_shown(getattr(limits, k)) for k in KINDS))))


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
    set_limits = sub.add_parser(
        "set-limits", help="set a user's or a key's limits (only the flags given change)",
        description="Set a user's or a key's limits; only the flags given change, 'none' removes a limit. "
                    f"Windows are UTC; {APPLIES}.")
    target = set_limits.add_mutually_exclusive_group(required=True)
    target.add_argument("--user", metavar="NAME", help="a user's limits (every key of theirs counts against them)")
    target.add_argument("--key", metavar="KEY_ID", help="a key's limits (key_…, see list-keys; rotation keeps them)")
    for kind in KINDS:
        whole = kind in ("tokens_per_day", "requests_per_minute", "tokens_per_minute")
        per = kind.rsplit("_per_", 1)[1]
        set_limits.add_argument("--" + kind.replace("_", "-"), dest=kind, type=_limit(kind), default=argparse.SUPPRESS,
                                metavar="N|none" if whole else "X|none",
                                help=f"{UNITS[kind]} per UTC {'calendar month' if per == 'month' else per}, or 'none'")
    show = sub.add_parser("limits", help="list every user's and every usable key's limits (tab-separated)")
    revoke = sub.add_parser("revoke-key", help="revoke any user's key (active or rotated) at once")
    revoke.add_argument("key_id", help="the key's id (key_…, see list-keys)")
    role = sub.add_parser("set-role", help="make a user admin or user (their sessions end)")
    role.add_argument("name")
    role.add_argument("role", choices=ROLES)
    disable = sub.add_parser("disable-user", help="no sign-in and every key refused, until enable-user")
    enable = sub.add_parser("enable-user", help="undo disable-user")
    delete = sub.add_parser("delete-user", help="delete a user: every key revoked, the name free again")
    for p in (disable, enable, delete):
        p.add_argument("name")
    managed = (revoke, role, disable, enable, delete)
    for p in (create, reset, listing, keys, quota, set_limits, show, *managed):
        p.add_argument("--data-dir", help="the gateway's data directory (default: $LLMGW_DATA_DIR or ./data)")
    args = parser.parse_args(argv)
    store = IdentityStore(data_dir(args.data_dir) / "identity")
    try:
        if args.command == "list-users":
            for user in store.users():
                print(f"{user.name}\t{user.role}\t{'disabled' if user.disabled else 'active'}")
            return
        if args.command == "revoke-key":
            key = store.key_by_id(args.key_id)
            if key is None:
                raise IdentityError("key_id", f"no key with id {args.key_id!r} (see llmgw admin list-keys)")
            store.revoke_key(args.key_id, time.time())
            print(f"key {args.key_id} ({key.name}) revoked; {APPLIES}")
            return
        if args.command in ("set-role", "disable-user", "enable-user", "delete-user"):
            managed_user = store.user_by_name(args.name)
            if managed_user is None:
                raise IdentityError("name", f"no user named {args.name!r} (see llmgw admin list-users)")
            if args.command == "set-role":
                store.set_role(managed_user.user_id, args.role)
                print(f"{args.name!r} is now {args.role}; their sessions were ended")
            elif args.command == "delete-user":
                store.delete_user(managed_user.user_id, time.time())
                print(f"{args.name!r} deleted; every key of theirs is revoked")
            else:
                store.set_disabled(managed_user.user_id, args.command == "disable-user", time.time())
                print(f"{args.name!r} {'disabled' if args.command == 'disable-user' else 'enabled'}; {APPLIES}")
            return
        if args.command == "list-keys":
            names = {u.user_id: u.name for u in store.users()}
            if args.user is not None and args.user not in names.values():
                raise IdentityError("user", f"no user named {args.user!r}")
            now = time.time()
            for key in store.keys_of(None):
                if args.user is None or names.get(key.user_id) == args.user:
                    quota_text = "none" if key.daily_quota is None else str(key.daily_quota)
                    print(f"{key.key_id}\t{names.get(key.user_id, '?')}\t{key.name}\t{key.hint}\t{quota_text}\t"
                          f"{key.status(now)}")
            return
        if args.command == "set-limits":
            _set_limits(store, args)
            return
        if args.command == "limits":
            _print_limits(store)
            return
        if args.command == "set-quota":
            if store.key_by_id(args.key_id) is None:
                raise IdentityError("key_id", f"no key with id {args.key_id!r} (see llmgw admin list-keys)")
            store.set_quota(args.key_id, args.quota)
            shown = "none" if args.quota is None else f"{args.quota:,} tokens per UTC day"
            print(f"daily quota of {args.key_id} set to {shown}; {APPLIES}")
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
