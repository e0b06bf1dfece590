"""Identity: password hashing, API keys (hash-only storage, rotation grace, revocation), sessions,
sign-in back-off, quotas. Real SQLite files in tmp_path; the clock is passed in."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from services.gateway.auth import FREE_LOGIN_FAILURES, MAX_LOGIN_DELAY_S, Auth, LoginThrottle
from services.gateway.identity import (
    IdentityError,
    IdentityStore,
    hash_password,
    key_digest,
    seconds_to_utc_midnight,
    verify_password,
)

T0 = 1_790_000_000.0  # 2026-09-21 (a fixed clock)


@pytest.fixture
def store(tmp_path: Path) -> IdentityStore:
    s = IdentityStore(tmp_path / "identity")
    yield s
    s.close()


def test_passwords_are_scrypt_hashed_salted_and_verified() -> None:
    a, b = hash_password("correct horse"), hash_password("correct horse")
    assert a.startswith("scrypt$16384$8$1$") and a != b  # salted
    assert verify_password("correct horse", a) and not verify_password("wrong horse", a)
    assert not verify_password("x", "md5$abc") and not verify_password("x", "garbage")


def test_api_keys_are_stored_only_as_digests_and_shown_once(store: IdentityStore, tmp_path: Path) -> None:
    user = store.create_user("alice", hash_password("p" * 12), "user")
    key, record = store.create_key(user.user_id, "laptop", None, T0)
    assert key.startswith("sk-") and len(key) >= 40
    assert record.hint.endswith(key[-4:]) and key not in record.hint
    raw = sqlite3.connect(tmp_path / "identity" / "identity.db").execute("SELECT * FROM api_keys").fetchall()
    assert key not in repr(raw) and key_digest(key) in repr(raw)
    assert store.lookup_key(key_digest(key), T0) == record
    assert store.lookup_key(key_digest(key + "x"), T0) is None


def test_rotation_keeps_the_old_key_for_the_grace_window_then_revocation_is_immediate(store: IdentityStore) -> None:
    user = store.create_user("bob", hash_password("p" * 12), "user")
    old_key, old = store.create_key(user.user_id, "ci", 1000, T0)
    new_key, new = store.rotate_key(old.key_id, grace_s=3600, now_s=T0 + 10)
    assert new.daily_quota == 1000 and new.name == "ci"
    assert store.lookup_key(key_digest(old_key), T0 + 3000) is not None  # inside the grace window
    assert store.lookup_key(key_digest(old_key), T0 + 3611) is None  # past it
    with pytest.raises(IdentityError):
        store.rotate_key(old.key_id, 60, T0 + 4000)  # an expired key cannot be rotated again
    store.revoke_key(new.key_id, T0 + 20)
    assert store.lookup_key(key_digest(new_key), T0 + 21) is None


def test_sessions_are_signed_expire_and_are_revocable(store: IdentityStore, tmp_path: Path) -> None:
    user = store.create_user("carol", hash_password("p" * 12), "admin")
    cookie, _ = store.create_session(user, T0, ttl_s=60)
    assert store.session(cookie, T0 + 1) is not None
    assert store.session(cookie, T0 + 61) is None  # expired
    token, _, sig = cookie.rpartition(".")
    assert store.session(f"{token}.{'0' * len(sig)}", T0) is None  # forged signature
    assert store.session(token, T0) is None and store.session(None, T0) is None
    other = IdentityStore(tmp_path / "other")  # a different secret cannot vouch for our cookies
    assert other.session(cookie, T0) is None
    other.close()
    cookie2, _ = store.create_session(user, T0)
    store.end_session(cookie2)
    assert store.session(cookie2, T0) is None
    cookie3, _ = store.create_session(user, T0)
    store.end_sessions_of(user.user_id)
    assert store.session(cookie3, T0) is None


def test_user_names_and_duplicates_are_checked(store: IdentityStore) -> None:
    store.create_user("dave", "h", "user")
    with pytest.raises(IdentityError, match="exists"):
        store.create_user("dave", "h", "user")
    with pytest.raises(IdentityError):
        store.create_user("bad name!", "h", "user")
    with pytest.raises(IdentityError):
        store.create_user("eve", "h", "root")  # type: ignore[arg-type]


def test_login_backoff_grows_per_address_and_user_and_is_bounded() -> None:
    throttle = LoginThrottle()
    delays = [throttle.failed("1.2.3.4", "admin", T0) for _ in range(FREE_LOGIN_FAILURES + 12)]
    assert delays[: FREE_LOGIN_FAILURES - 1] == [0.0] * (FREE_LOGIN_FAILURES - 1)
    assert delays[FREE_LOGIN_FAILURES - 1] == 1.0 and delays[FREE_LOGIN_FAILURES] == 2.0
    assert max(delays) == MAX_LOGIN_DELAY_S
    assert throttle.wait_s("1.2.3.4", "admin", T0) == MAX_LOGIN_DELAY_S
    assert throttle.wait_s("5.6.7.8", "admin", T0) == 0.0  # another address is not locked out
    assert throttle.wait_s("1.2.3.4", "root", T0) == 0.0
    throttle.succeeded("1.2.3.4", "admin")
    assert throttle.wait_s("1.2.3.4", "admin", T0) == 0.0


def test_quota_counts_tokens_per_utc_day_and_survives_a_restart(tmp_path: Path) -> None:
    store = IdentityStore(tmp_path / "identity")
    user = store.create_user("frank", "h", "user")
    _, key = store.create_key(user.user_id, "k", 100, T0)
    auth = Auth(store)
    auth.finished(auth.admit_key(key, T0), 60, T0)
    auth.save_usage()
    store.close()
    store = IdentityStore(tmp_path / "identity")
    auth = Auth(store)
    assert auth.used_today(key.key_id, T0) == 60
    auth.finished(auth.admit_key(key, T0), 50, T0)
    with pytest.raises(Exception) as info:
        auth.admit_key(key, T0)
    assert info.value.status == 429 and info.value.code == "quota_exceeded"  # type: ignore[attr-defined]
    assert info.value.retry_after_s == seconds_to_utc_midnight(T0)  # type: ignore[attr-defined]
    next_day = T0 + seconds_to_utc_midnight(T0) + 1
    assert auth.admit_key(key, next_day).key is key  # a new UTC day, a new quota
    store.close()


def test_open_requests_per_key_are_capped(tmp_path: Path) -> None:
    store = IdentityStore(tmp_path / "identity")
    user = store.create_user("gina", "h", "user")
    _, key = store.create_key(user.user_id, "k", None, T0)
    auth = Auth(store, max_concurrent_per_key=2)
    first = auth.admit_key(key, T0)
    auth.admit_key(key, T0)
    with pytest.raises(Exception) as info:
        auth.admit_key(key, T0)
    assert info.value.status == 429 and info.value.code == "too_many_concurrent_requests"  # type: ignore[attr-defined]
    auth.finished(first, 0, T0)
    assert auth.admit_key(key, T0).key is key
    store.close()


def test_seconds_to_utc_midnight() -> None:
    assert seconds_to_utc_midnight(86400.0 * 100) == 86400.0
    assert seconds_to_utc_midnight(86400.0 * 100 + 86399.5) == 1.0  # at least a second
