"""Users, sessions and API keys: one SQLite file in the gateway's data dir (``identity/identity.db``).

Why these choices:

- **Passwords** are hashed with scrypt (memory-hard: N=2^14, r=8, p=1, 16 MiB per guess) and a per-user
  salt; verifying one costs ~50 ms, so callers run it off the event loop.
- **API keys** are 240 random bits (``sk-`` + 40 URL-safe base64 characters). A key that random cannot be
  guessed, so a fast hash is enough (as for GitHub tokens): we store ``sha256(key)`` and look a request's
  key up by that digest in memory, O(1) per request, with no KDF on the hot path. The key itself is shown
  once and never stored or logged; usage is attributed to its public ``key_id``.
- **Sessions** are random 256-bit tokens; the cookie carries ``token.signature`` (HMAC-SHA256 with a
  secret kept in ``identity/secret``, mode 0600) and the database keeps only ``sha256(token)``, so a
  leaked database cannot be replayed as cookies, and deleting the row revokes the session.
- SQLite gives atomic, crash-safe writes: a kill -9 mid-change leaves the old or the new state.
- **Replicas**: every change to a user or a key is handed to ``on_change`` (the gateway puts it in a
  bus bucket, :mod:`services.gateway.identity_sync`), and :meth:`IdentityStore.apply_replica` takes the
  other gateways' changes: the newer ``updated_s`` wins. Sessions and the cookie secret stay with the
  gateway that signed the user in.

Everything here is synchronous and small; the gateway calls it from the event loop except password
hashing (see :func:`hash_password`).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime as dt
import hashlib
import hmac
import math
import os
import secrets
import sqlite3
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from services.gateway.limits import KINDS, Limits, Principal, key_principal, user_principal

Role = Literal["admin", "user"]
ROLES: tuple[Role, ...] = ("admin", "user")

SESSION_TTL_S = 12 * 3600.0
KEY_PREFIX = "sk-"
_SCRYPT = {"n": 2**14, "r": 8, "p": 1, "maxmem": 64 * 1024 * 1024, "dklen": 32}

SCHEMA = """
CREATE TABLE IF NOT EXISTS users (
    user_id    TEXT PRIMARY KEY,
    name       TEXT NOT NULL UNIQUE,
    role       TEXT NOT NULL CHECK (role IN ('admin', 'user')),
    pw_hash    TEXT NOT NULL,
    created_s  REAL NOT NULL,
    updated_s  REAL NOT NULL DEFAULT 0,
    disabled_s REAL,  -- set: cannot sign in, keys refused (an admin can enable it again)
    deleted_s  REAL   -- set: gone (keys revoked, name released as "deleted-<user_id>"); kept for replication
);
CREATE TABLE IF NOT EXISTS sessions (
    token_sha256 TEXT PRIMARY KEY,
    user_id      TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
    csrf         TEXT NOT NULL,
    created_s    REAL NOT NULL,
    expires_s    REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    key_id       TEXT PRIMARY KEY,
    user_id      TEXT NOT NULL REFERENCES users(user_id) ON DELETE CASCADE,
    name         TEXT NOT NULL,
    key_sha256   TEXT NOT NULL UNIQUE,
    hint         TEXT NOT NULL,
    daily_quota  INTEGER,
    created_s    REAL NOT NULL,
    expires_s    REAL,
    revoked_s    REAL,
    replaced_by  TEXT,
    updated_s    REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS limits (
    principal            TEXT PRIMARY KEY,  -- "user-<user_id>" or "key-<lineage key id>" (services/gateway/limits.py)
    tokens_per_day       INTEGER,
    requests_per_minute  INTEGER,
    tokens_per_minute    INTEGER,
    usd_per_month        REAL,
    kwh_per_month        REAL,
    updated_s            REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS limit_usage (
    counter  TEXT PRIMARY KEY,  -- "<principal>|<kind>|<window>": this gateway's settled amount
    amount   REAL NOT NULL
);
"""


# The replicated tables: primary key first, then every column a replica row carries.
REPLICATED: dict[str, tuple[str, ...]] = {
    "users": ("user_id", "name", "role", "pw_hash", "created_s", "updated_s", "disabled_s", "deleted_s"),
    "api_keys": ("key_id", "user_id", "name", "key_sha256", "hint", "daily_quota", "created_s", "expires_s",
                 "revoked_s", "replaced_by", "updated_s"),
    "limits": ("principal", "tokens_per_day", "requests_per_minute", "tokens_per_minute", "usd_per_month",
               "kwh_per_month", "updated_s"),
}


class IdentityError(ValueError):
    """A request to change identities that cannot be done (the message says why, for a form)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class User:
    user_id: str
    name: str
    role: Role
    disabled: bool = False  # disabled or deleted: no sign-in, no key works

    @classmethod
    def of_row(cls, user_id: str, name: str, role: Role, disabled_s: float | None, deleted_s: float | None) -> User:
        return cls(user_id, name, role, disabled_s is not None or deleted_s is not None)


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    user_id: str
    name: str
    key_sha256: str
    hint: str  # "sk-…abcd": enough to recognise a key in a list, useless to an attacker
    daily_quota: int | None
    created_s: float
    expires_s: float | None  # set when rotated: the old key keeps working until then
    revoked_s: float | None
    replaced_by: str | None
    # The first key of this key's rotation chain (itself when never rotated): limits and their counters
    # attach to it, so a rotated key carries its spend on (derived from ``replaced_by`` at load).
    lineage: str = ""

    def is_valid(self, now_s: float) -> bool:
        return self.revoked_s is None and (self.expires_s is None or now_s < self.expires_s)

    def status(self, now_s: float) -> str:
        """``revoked``, ``expired``, ``rotated`` (replaced, still working until ``expires_s``) or ``active``."""
        if self.revoked_s is not None:
            return "revoked"
        if self.expires_s is not None:
            return "expired" if now_s >= self.expires_s else "rotated"
        return "active"


@dataclass(frozen=True)
class Session:
    user: User
    csrf: str
    expires_s: float


def hash_password(password: str, salt: bytes | None = None) -> str:
    """scrypt; ~50 ms and 16 MiB: call it in a thread from async code."""
    salt = salt or os.urandom(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, **_SCRYPT)
    return f"scrypt$16384$8$1${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def verify_password(password: str, stored: str) -> bool:
    try:
        scheme, n, r, p, salt_b64, digest_b64 = stored.split("$")
        if scheme != "scrypt":
            return False
        digest = hashlib.scrypt(password.encode(), salt=base64.b64decode(salt_b64), n=int(n), r=int(r), p=int(p),
                                maxmem=_SCRYPT["maxmem"], dklen=len(base64.b64decode(digest_b64)))
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(digest, base64.b64decode(digest_b64))


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(30)


def new_password() -> str:
    return secrets.token_urlsafe(15)


def utc_day(now_s: float) -> str:
    return dt.datetime.fromtimestamp(now_s, dt.UTC).strftime("%Y-%m-%d")


def seconds_to_utc_midnight(now_s: float) -> float:
    day = dt.datetime.fromtimestamp(now_s, dt.UTC).date()
    midnight = dt.datetime.combine(day + dt.timedelta(days=1), dt.time(), dt.UTC)
    return max(1.0, midnight.timestamp() - now_s)


MAX_DAILY_QUOTA = 10**12  # tokens; far above any real day, and well inside SQLite's 64-bit INTEGER


def parse_daily_quota(text: str) -> int | None:
    """A daily token quota field: empty → None (no quota), else a whole number of tokens, 1 or more.

    Thousands separators ("1,000" or "1_000") are accepted. Raises IdentityError("daily_quota", why) for
    anything else, so the form shows the reason next to the field.
    """
    text = text.strip().replace(",", "").replace("_", "")
    if not text:
        return None
    digits = text.removeprefix("-")
    if not (digits.isascii() and digits.isdigit()):
        raise IdentityError("daily_quota", "must be a whole number of tokens, or empty for no quota")
    if text.startswith("-"):
        raise IdentityError("daily_quota", "must not be negative")
    value = int(text)
    if value < 1:
        raise IdentityError("daily_quota", "must be at least 1 token (empty: no quota; to stop a key, revoke it)")
    if value > MAX_DAILY_QUOTA:
        raise IdentityError("daily_quota", f"must be at most {MAX_DAILY_QUOTA:,} tokens (empty: no quota)")
    return value


NO_LIMITS = Limits()
MAX_TOKEN_LIMIT = 10**12


def check_limits(limits: Limits) -> None:
    """Raises IdentityError(kind, why) for a limit that cannot be meant."""
    for kind in KINDS:
        value = limits.get(kind)
        if value is None:
            continue
        if not math.isfinite(value) or value <= 0:
            raise IdentityError(kind, "must be a positive number, or empty for no limit")
        if kind in ("tokens_per_day", "requests_per_minute", "tokens_per_minute"):
            if value != int(value) or value > MAX_TOKEN_LIMIT:
                raise IdentityError(kind, f"must be a whole number up to {MAX_TOKEN_LIMIT:,}")
        elif value > 1e12:
            raise IdentityError(kind, "is beyond any plausible budget")


def parse_limit(kind: str, text: str) -> float | int | None:
    """A limit form field: empty or ``none`` → None (no limit); thousands separators accepted."""
    cleaned = text.strip().replace(",", "").replace("_", "")
    if cleaned == "" or cleaned.lower() == "none":
        return None
    try:
        value: float | int = int(cleaned) if kind in ("tokens_per_day", "requests_per_minute",
                                                          "tokens_per_minute") else float(cleaned)
    except ValueError:
        raise IdentityError(kind, "must be a number, or empty for no limit") from None
    check_limits(dataclasses.replace(NO_LIMITS, **{kind: value}))  # type: ignore[arg-type]  # kind is a field name known at run time only; check_limits checks the value
    return value


def check_password_rules(password: str) -> None:
    if len(password) < 10:
        raise IdentityError("password", "use at least 10 characters")
    if len(password) > 1024:
        raise IdentityError("password", "use at most 1024 characters")


def check_user_name(name: str) -> None:
    if not (1 <= len(name) <= 64) or not all(c.isalnum() or c in "._-@" for c in name):
        raise IdentityError("name", "1-64 letters, digits or . _ - @")


class IdentityStore:
    """Users, sessions and keys in SQLite; API keys mirrored in memory for O(1) request checks."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True, mode=_PRIVATE_DIR_MODE)
        self.path = directory / "identity.db"
        _make_private(directory, self.path)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.executescript(SCHEMA)
        for table in REPLICATED:  # identity.db files from before replication lack updated_s
            if "updated_s" not in {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}:
                self.db.execute(f"ALTER TABLE {table} ADD COLUMN updated_s REAL NOT NULL DEFAULT 0")
        have = {row[1] for row in self.db.execute("PRAGMA table_info(users)")}
        for column in ("disabled_s", "deleted_s"):  # files from before user management
            if column not in have:
                self.db.execute(f"ALTER TABLE users ADD COLUMN {column} REAL")
        self.on_change: Callable[[str, dict[str, object]], None] | None = None  # (table, row) after a change
        self._updated_s = 0.0
        self._secret = _load_secret(directory / "secret")
        self._keys: dict[str, ApiKey] = {}  # by key_sha256
        self._users: dict[str, User] = {}
        self._limits: dict[str, Limits] = {}  # by principal id
        self.reload_keys()
        self.reload_limits()

    def close(self) -> None:
        self.db.close()

    # ---- users --------------------------------------------------------------------------------------

    def has_users(self) -> bool:
        return self.db.execute("SELECT 1 FROM users LIMIT 1").fetchone() is not None

    def create_user(self, name: str, password_hash: str, role: Role) -> User:
        check_user_name(name)
        if role not in ROLES:
            raise IdentityError("role", f"must be one of {', '.join(ROLES)}")
        user = User(f"u_{secrets.token_hex(6)}", name, role)
        try:
            self.db.execute("INSERT INTO users (user_id, name, role, pw_hash, created_s, updated_s) "
                            "VALUES (?, ?, ?, ?, ?, ?)",
                            (user.user_id, name, role, password_hash, time.time(), self._stamp()))
        except sqlite3.IntegrityError:
            raise IdentityError("name", f"a user named {name!r} exists already") from None
        self._users[user.user_id] = user
        self._changed("users", user.user_id)
        return user

    def bootstrap_admin(self, now_s: float, password: str | None = None) -> tuple[str, str]:
        """First start (no users yet): user ``admin`` with ``password`` (the operator's ``$LLMGW_ADMIN_PASSWORD``)
        or a generated one, and one API key.

        Returns both so the caller can show them once; only their hashes are kept.
        """
        if password is not None:
            check_password_rules(password)
        password = password or new_password()
        user = self.create_user("admin", hash_password(password), "admin")
        key, _ = self.create_key(user.user_id, "bootstrap", None, now_s)
        return password, key

    def set_password(self, user_id: str, password_hash: str) -> None:
        self.db.execute("UPDATE users SET pw_hash = ?, updated_s = ? WHERE user_id = ?",
                        (password_hash, self._stamp(), user_id))
        self._changed("users", user_id)

    def password_hash(self, name: str) -> tuple[User, str] | None:
        row = self.db.execute("SELECT user_id, name, role, disabled_s, deleted_s, pw_hash FROM users "
                              "WHERE name = ? AND deleted_s IS NULL", (name,)).fetchone()
        return (User.of_row(*row[:5]), row[5]) if row else None

    def user(self, user_id: str) -> User | None:
        if user_id not in self._users:
            row = self.db.execute("SELECT user_id, name, role, disabled_s, deleted_s FROM users WHERE user_id = ?",
                                  (user_id,)).fetchone()
            if row is None:
                return None
            self._users[user_id] = User.of_row(*row)
        return self._users[user_id]

    def users(self) -> list[User]:
        """Every user not deleted (disabled ones included), by name."""
        return [User.of_row(*row) for row in self.db.execute(
            "SELECT user_id, name, role, disabled_s, deleted_s FROM users WHERE deleted_s IS NULL ORDER BY name")]

    def user_by_name(self, name: str) -> User | None:
        found = self.password_hash(name)
        return found[0] if found else None

    def _other_active_admins(self, user_id: str) -> int:
        return sum(1 for u in self.users() if u.role == "admin" and not u.disabled and u.user_id != user_id)

    def _guard_last_admin(self, user: User, what: str) -> None:
        if user.role == "admin" and not user.disabled and self._other_active_admins(user.user_id) == 0:
            raise IdentityError("user", f"cannot {what} {user.name!r}: it is the last active admin "
                                        "(make another user admin first)")

    def set_role(self, user_id: str, role: Role) -> User:
        """Change a user's role; their sessions end (a page signed in with the old role must not linger)."""
        user = self._existing(user_id)
        if role not in ROLES:
            raise IdentityError("role", f"must be one of {', '.join(ROLES)}")
        if role != "admin":
            self._guard_last_admin(user, "demote")
        self.db.execute("UPDATE users SET role = ?, updated_s = ? WHERE user_id = ?", (role, self._stamp(), user_id))
        return self._user_changed(user_id)

    def set_disabled(self, user_id: str, disabled: bool, now_s: float) -> User:
        """Disable (no sign-in, every key refused, sessions ended) or enable a user again."""
        user = self._existing(user_id)
        if disabled:
            self._guard_last_admin(user, "disable")
        self.db.execute("UPDATE users SET disabled_s = ?, updated_s = ? WHERE user_id = ?",
                        (now_s if disabled else None, self._stamp(), user_id))
        return self._user_changed(user_id)

    def delete_user(self, user_id: str, now_s: float) -> None:
        """Delete a user: every key revoked, sessions ended, the name free for a new user. The row stays as a
        tombstone (``deleted_s``) so other gateways learn of it and usage keeps its owner id."""
        user = self._existing(user_id)
        self._guard_last_admin(user, "delete")
        for key in self.keys_of(user_id):
            if key.revoked_s is None:
                self.revoke_key(key.key_id, now_s)
        self.db.execute("UPDATE users SET deleted_s = ?, name = ?, updated_s = ? WHERE user_id = ?",
                        (now_s, f"deleted-{user_id}", self._stamp(), user_id))
        self._user_changed(user_id)

    def _existing(self, user_id: str) -> User:
        self._users.pop(user_id, None)
        user = self.user(user_id)
        if user is None or self.db.execute("SELECT deleted_s FROM users WHERE user_id = ?",
                                           (user_id,)).fetchone()[0] is not None:
            raise IdentityError("user", "no such user")
        return user

    def _user_changed(self, user_id: str) -> User:
        self._users.pop(user_id, None)
        self.end_sessions_of(user_id)
        self._changed("users", user_id)
        user = self.user(user_id)
        assert user is not None
        return user

    # ---- sessions -----------------------------------------------------------------------------------

    def _sign(self, token: str) -> str:
        return hmac.new(self._secret, token.encode(), hashlib.sha256).hexdigest()[:32]

    def create_session(self, user: User, now_s: float, ttl_s: float = SESSION_TTL_S) -> tuple[str, Session]:
        """A fresh session (never reuse one across a login: no fixation); returns the cookie value."""
        token = secrets.token_urlsafe(32)
        csrf = secrets.token_urlsafe(24)
        self.db.execute("INSERT INTO sessions VALUES (?, ?, ?, ?, ?)",
                        (key_digest(token), user.user_id, csrf, now_s, now_s + ttl_s))
        self.db.execute("DELETE FROM sessions WHERE expires_s < ?", (now_s,))
        return f"{token}.{self._sign(token)}", Session(user, csrf, now_s + ttl_s)

    def session(self, cookie: str | None, now_s: float) -> Session | None:
        if not cookie or "." not in cookie:
            return None
        token, _, signature = cookie.rpartition(".")
        if not hmac.compare_digest(signature.encode(), self._sign(token).encode()):  # bytes: non-ASCII is no TypeError
            return None
        row = self.db.execute("SELECT user_id, csrf, expires_s FROM sessions WHERE token_sha256 = ?",
                              (key_digest(token),)).fetchone()
        if row is None or row[2] <= now_s:
            return None
        user = self.user(row[0])
        return Session(user, row[1], row[2]) if user and not user.disabled else None

    def end_session(self, cookie: str | None) -> None:
        if cookie and "." in cookie:
            self.db.execute("DELETE FROM sessions WHERE token_sha256 = ?", (key_digest(cookie.rpartition(".")[0]),))

    def end_sessions_of(self, user_id: str) -> None:
        self.db.execute("DELETE FROM sessions WHERE user_id = ?", (user_id,))

    def sign_value(self, value: str) -> str:
        """A value only this gateway could have issued (the sign-in form's CSRF token)."""
        return f"{value}.{self._sign('v:' + value)}"

    def check_signed(self, signed: str) -> bool:
        value, _, signature = signed.rpartition(".")
        return bool(value) and hmac.compare_digest(signature.encode(), self._sign("v:" + value).encode())

    # ---- API keys -----------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Forget what is cached in memory: another process (``llmgw admin``) may have changed the file.

        The gateway calls it every ``identity_sync.RESYNC_S`` (15 s), so a key, quota or limit changed by
        ``llmgw admin`` applies within that period."""
        self._users.clear()
        self.reload_keys()
        self.reload_limits()

    def reload_keys(self) -> None:
        rows = self.db.execute(
            "SELECT key_id, user_id, name, key_sha256, hint, daily_quota, created_s, expires_s, revoked_s, "
            "replaced_by FROM api_keys").fetchall()
        keys = [ApiKey(*row) for row in rows]
        predecessor = {k.replaced_by: k.key_id for k in keys if k.replaced_by}

        def lineage(key_id: str) -> str:
            seen = {key_id}
            while (before := predecessor.get(key_id)) is not None and before not in seen:
                seen.add(before)
                key_id = before
            return key_id
        self._keys = {k.key_sha256: dataclasses.replace(k, lineage=lineage(k.key_id)) for k in keys}

    def create_key(self, user_id: str, name: str, daily_quota: int | None, now_s: float) -> tuple[str, ApiKey]:
        """Returns the key itself (show it once) and its record."""
        name = name.strip() or "key"
        if len(name) > 64:
            raise IdentityError("name", "use at most 64 characters")
        if daily_quota is not None and daily_quota < 1:
            raise IdentityError("daily_quota", "must be a positive number of tokens, or empty for no quota")
        key = new_api_key()
        key_id = f"key_{secrets.token_hex(8)}"
        record = ApiKey(key_id, user_id, name, key_digest(key), f"{KEY_PREFIX}…{key[-4:]}",
                        daily_quota, now_s, None, None, None, key_id)
        self.db.execute("INSERT INTO api_keys (key_id, user_id, name, key_sha256, hint, daily_quota, created_s, "
                        "updated_s) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (record.key_id, user_id, record.name, record.key_sha256, record.hint, daily_quota, now_s,
                         self._stamp()))
        self._keys[record.key_sha256] = record
        self._changed("api_keys", record.key_id)
        return key, record

    def keys_of(self, user_id: str | None) -> list[ApiKey]:
        """A user's keys (every key for ``None``), newest first."""
        keys = [k for k in self._keys.values() if user_id is None or k.user_id == user_id]
        return sorted(keys, key=lambda k: k.created_s, reverse=True)

    def key_by_id(self, key_id: str) -> ApiKey | None:
        return next((k for k in self._keys.values() if k.key_id == key_id), None)

    def revoke_key(self, key_id: str, now_s: float) -> None:
        self.db.execute("UPDATE api_keys SET revoked_s = ?, updated_s = ? WHERE key_id = ? AND revoked_s IS NULL",
                        (now_s, self._stamp(), key_id))
        self.reload_keys()
        self._changed("api_keys", key_id)

    def rotate_key(self, key_id: str, grace_s: float, now_s: float) -> tuple[str, ApiKey]:
        """A new key with the same name and quota; the old one keeps working for ``grace_s``."""
        old = self.key_by_id(key_id)
        if old is None or not old.is_valid(now_s):
            raise IdentityError("key", "that key is revoked or expired: create a new one")
        if not 0 <= grace_s <= 30 * 86400:
            raise IdentityError("grace_hours", "must lie between 0 and 720 hours")
        key, new = self.create_key(old.user_id, old.name, old.daily_quota, now_s)
        self.db.execute("UPDATE api_keys SET expires_s = ?, replaced_by = ?, updated_s = ? WHERE key_id = ?",
                        (now_s + grace_s, new.key_id, self._stamp(), key_id))
        self.reload_keys()
        self._changed("api_keys", key_id)
        return key, self.key_by_id(new.key_id) or new  # as reloaded: its lineage is the old key's

    def set_quota(self, key_id: str, daily_quota: int | None) -> None:
        if daily_quota is not None and daily_quota < 1:
            raise IdentityError("daily_quota", "must be a positive number of tokens, or empty for no quota")
        self.db.execute("UPDATE api_keys SET daily_quota = ?, updated_s = ? WHERE key_id = ?",
                        (daily_quota, self._stamp(), key_id))
        self.reload_keys()
        self._changed("api_keys", key_id)

    def lookup_key(self, digest: str, now_s: float) -> ApiKey | None:
        key = self._keys.get(digest)
        if key is None or not key.is_valid(now_s):
            return None
        owner = self.user(key.user_id)  # cached: a dict look-up per request
        return key if owner is not None and not owner.disabled else None

    # ---- replication (see the module doc) -----------------------------------------------------------

    def _stamp(self) -> float:
        """A change's time: wall clock, strictly increasing here so two quick changes keep their order."""
        self._updated_s = max(time.time(), self._updated_s + 1e-6)
        return self._updated_s

    def _changed(self, table: str, pk: str) -> None:
        if self.on_change is not None:
            row = self.replica_row(table, pk)
            if row is not None:
                self.on_change(table, row)

    def replica_row(self, table: str, pk: str) -> dict[str, object] | None:
        columns = REPLICATED[table]
        found = self.db.execute(f"SELECT {', '.join(columns)} FROM {table} WHERE {columns[0]} = ?", (pk,)).fetchone()
        return dict(zip(columns, found, strict=True)) if found else None

    def replica_rows(self) -> list[tuple[str, dict[str, object]]]:
        """Every replicated row, users first (a key needs its user)."""
        return [(table, dict(zip(columns, found, strict=True)))
                for table, columns in REPLICATED.items()
                for found in self.db.execute(f"SELECT {', '.join(columns)} FROM {table}")]

    def apply_replica(self, table: str, row: dict[str, object]) -> bool:
        """Take another gateway's version of a row when it is newer than ours. True when it changed ours.

        Raises :class:`ValueError` for a malformed row and :class:`sqlite3.IntegrityError` for one that
        cannot stand here (its user is not known yet, or a different user holds its name).
        """
        columns = REPLICATED.get(table)
        if table == "users" and isinstance(row, dict):  # a gateway from before user management sends neither
            row = {"disabled_s": None, "deleted_s": None, **row}
        if columns is None or not isinstance(row, dict) or set(row) != set(columns):
            raise ValueError(f"not a {table} row: {sorted(row) if isinstance(row, dict) else type(row).__name__}")
        if not isinstance(row["updated_s"], (int, float)):
            raise ValueError("updated_s must be a number")
        if table == "users" and row["role"] not in ROLES:
            raise ValueError(f"unknown role {row['role']!r}")
        if table == "limits":
            try:
                check_limits(Limits(**{k: row[k] for k in KINDS}))  # type: ignore[arg-type]  # a peer's row: check_limits (and TypeError) refuse a bad value
            except (IdentityError, TypeError) as exc:
                raise ValueError(f"bad limits for {row['principal']!r}: {exc}") from None
        updates = ", ".join(f"{c} = excluded.{c}" for c in columns[1:])
        cursor = self.db.execute(
            f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))}) "
            f"ON CONFLICT ({columns[0]}) DO UPDATE SET {updates} WHERE excluded.updated_s > {table}.updated_s",
            [row[c] for c in columns])
        if cursor.rowcount <= 0:
            stored = self.db.execute(f"SELECT updated_s FROM {table} WHERE {columns[0]} = ?",
                                     (row[columns[0]],)).fetchone()
            if stored is not None and stored[0] == row["updated_s"]:
                # The file holds this very version already: written here, or by another process on the same
                # file (a sibling worker of `llmgw gateway --workers`) that took it first. Our in-memory copy
                # may predate it: without this a key that worker revoked kept working here until the next
                # resync (15 s).
                self._forget_cached(table, row)
            return False
        self._forget_cached(table, row)
        return True

    def _forget_cached(self, table: str, row: dict[str, object]) -> None:
        self._updated_s = max(self._updated_s, float(row["updated_s"]))  # type: ignore[arg-type]  # checked a number above
        if table == "users":
            self._users.pop(str(row["user_id"]), None)
        elif table == "limits":
            self.reload_limits()
        else:
            self.reload_keys()

    # ---- limits (services/gateway/limits.py) -----------------------------------------------------------

    def reload_limits(self) -> None:
        rows = self.db.execute("SELECT principal, tokens_per_day, requests_per_minute, tokens_per_minute, "
                               "usd_per_month, kwh_per_month FROM limits").fetchall()
        self._limits = {row[0]: Limits(*row[1:]) for row in rows}

    def limits_of(self, principal_id: str) -> Limits:
        return self._limits.get(principal_id, NO_LIMITS)

    def all_limits(self) -> dict[str, Limits]:
        return dict(self._limits)

    def set_limits(self, principal_id: str, limits: Limits) -> None:
        """Set a user's (``user-<id>``) or a key lineage's (``key-<lineage>``) limits; only admins may
        (the pages and ``llmgw admin`` check the role). A key's tokens per day stays its ``daily_quota``."""
        check_limits(limits)
        self.db.execute(
            "INSERT INTO limits VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (principal) DO UPDATE SET "
            "tokens_per_day = excluded.tokens_per_day, requests_per_minute = excluded.requests_per_minute, "
            "tokens_per_minute = excluded.tokens_per_minute, usd_per_month = excluded.usd_per_month, "
            "kwh_per_month = excluded.kwh_per_month, updated_s = excluded.updated_s",
            (principal_id, limits.tokens_per_day, limits.requests_per_minute, limits.tokens_per_minute,
             limits.usd_per_month, limits.kwh_per_month, self._stamp()))
        self._limits[principal_id] = limits
        self._changed("limits", principal_id)

    def change_limits(self, principal_id: str, changes: Mapping[str, int | float | None]) -> Limits:
        """Set the kinds in ``changes`` (None: no limit), keep the others; nothing is written for none."""
        if changes:
            self.set_limits(principal_id, dataclasses.replace(self.limits_of(principal_id), **changes))  # type: ignore[arg-type]  # kinds known at run time only; set_limits checks the values
        return self.limits_of(principal_id)

    def key_limits(self, key: ApiKey) -> Limits:
        """A key's limits as set: its ``daily_quota`` for tokens per day, its lineage's row for the others."""
        return dataclasses.replace(self.limits_of(key_principal(key.lineage or key.key_id)),
                                   tokens_per_day=key.daily_quota)

    def change_key_limits(self, key_id: str, changes: Mapping[str, int | float | None]) -> Limits:
        """:meth:`change_limits` for a key: tokens per day goes to its ``daily_quota`` (:meth:`set_quota`),
        the other kinds to its lineage's row (whose tokens per day stays None). Check the values first
        (:func:`check_limits`): a refused quota after a written row would leave half a change."""
        rest = dict(changes)
        if "tokens_per_day" in rest:
            quota = rest.pop("tokens_per_day")
            self.set_quota(key_id, None if quota is None else int(quota))
        key = self.key_by_id(key_id)
        if key is None:
            raise IdentityError("key_id", f"no key with id {key_id!r}")
        if rest:
            self.change_limits(key_principal(key.lineage or key.key_id), {**rest, "tokens_per_day": None})
        return self.key_limits(key)

    def principals_of(self, key: ApiKey) -> tuple[Principal, Principal]:
        """The user's and the key's limits; the key's tokens per day is its ``daily_quota``."""
        own = self.limits_of(key_principal(key.lineage or key.key_id))
        if key.daily_quota is not None:
            own = dataclasses.replace(own, tokens_per_day=key.daily_quota)
        return (Principal(user_principal(key.user_id), self.limits_of(user_principal(key.user_id))),
                Principal(key_principal(key.lineage or key.key_id), own))

    def load_limit_usage(self, owner: str = "") -> dict[str, float]:
        """The counters :meth:`save_limit_usage` saved for ``owner`` (a worker label; "" for a gateway of one
        process, which takes every worker's rows, summed: it counts all their requests now). The first worker
        (``w0``) also takes the rows a gateway of one process saved, so switching to workers forgets nothing."""
        counters: dict[str, float] = {}
        for counter, amount in self.db.execute("SELECT counter, amount FROM limit_usage"):
            who, sep, name = counter.partition(_OWNER_SEP)
            if not sep:  # a gateway of one process saved it
                who, name = "", counter
            if not owner or who == owner or (not who and owner == FIRST_WORKER):
                counters[name] = counters.get(name, 0.0) + float(amount)
        return counters

    def save_limit_usage(self, counters: dict[str, float], owner: str = "") -> None:
        """Replace this gateway's settled day and month counters (one transaction: old or new, never half).

        The worker processes of one gateway (``--workers``) share this file, and each counts only its own
        requests (the others' arrive over the bus): each keeps its rows under its worker label, so one
        worker's save never overwrites another's."""
        rows = [(f"{owner}{_OWNER_SEP}{k}" if owner else k, v) for k, v in counters.items()]
        with self.db:
            self.db.execute("BEGIN")
            if not owner:  # a gateway of one process: it loaded every row
                self.db.execute("DELETE FROM limit_usage")
            else:
                self.db.execute("DELETE FROM limit_usage WHERE substr(counter, 1, ?) = ?",
                                (len(owner) + 1, owner + _OWNER_SEP))
                if owner == FIRST_WORKER:  # it took over the rows of a gateway of one process
                    self.db.execute("DELETE FROM limit_usage WHERE instr(counter, ?) = 0", (_OWNER_SEP,))
            self.db.executemany("INSERT INTO limit_usage VALUES (?, ?)", rows)


# limit_usage rows of one worker of several: "<worker><TAB><counter>" (a counter never holds a tab)
_OWNER_SEP = "\t"
FIRST_WORKER = "w0"
_PRIVATE_DIR_MODE = 0o700
_PRIVATE_FILE_MODE = 0o600


def _make_private(directory: Path, db: Path) -> None:
    """Password hashes, key digests and sessions are the owner's alone: the directory 0700; ``db`` created
    0600 before SQLite opens it (SQLite gives its -wal and -shm files the database file's mode), and an
    existing database, WAL or shared-memory file from an older version made 0600 (docs/deploy.md)."""
    if stat.S_IMODE(directory.stat().st_mode) != _PRIVATE_DIR_MODE:
        os.chmod(directory, _PRIVATE_DIR_MODE)
    with contextlib.suppress(FileExistsError):  # an empty file is a new database to SQLite
        os.close(os.open(db, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _PRIVATE_FILE_MODE))
    for path in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        with contextlib.suppress(FileNotFoundError):
            if stat.S_IMODE(path.stat().st_mode) != _PRIVATE_FILE_MODE:
                os.chmod(path, _PRIVATE_FILE_MODE)


def _load_secret(path: Path) -> bytes:
    """The HMAC secret for cookies: created once (0600, atomically), then read."""
    try:
        return bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError):
        pass
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return bytes.fromhex(path.read_text().strip())
