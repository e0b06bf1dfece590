"""Issue #25: an admin revokes any key, disables, enables or deletes a user and changes roles, in the
identity store and with ``llmgw admin``; the last active admin cannot be removed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from services.gateway import admin_cli
from services.gateway.identity import IdentityError, IdentityStore, key_digest


@pytest.fixture
def store(tmp_path: Path):  # type: ignore[no-untyped-def]
    s = IdentityStore(tmp_path / "identity")
    yield s
    s.close()


def test_a_disabled_user_has_no_session_and_no_working_key_until_enabled(store: IdentityStore) -> None:
    store.create_user("root", "scrypt$x", "admin")
    bob = store.create_user("bob", "scrypt$x", "user")
    key, _ = store.create_key(bob.user_id, "k", None, 0.0)
    cookie, _ = store.create_session(bob, 1.0)
    store.set_disabled(bob.user_id, True, 2.0)
    assert store.lookup_key(key_digest(key), 3.0) is None
    assert store.session(cookie, 3.0) is None  # ended, and a disabled user has none
    assert store.user_by_name("bob").disabled  # type: ignore[union-attr]
    store.set_disabled(bob.user_id, False, 4.0)
    assert store.lookup_key(key_digest(key), 5.0) is not None


def test_delete_revokes_every_key_frees_the_name_and_hides_the_user(store: IdentityStore) -> None:
    store.create_user("root", "scrypt$x", "admin")
    bob = store.create_user("bob", "scrypt$x", "user")
    keys = [store.create_key(bob.user_id, f"k{i}", None, 0.0)[0] for i in range(2)]
    store.rotate_key(store.keys_of(bob.user_id)[0].key_id, 3600, 1.0)  # one in its grace period
    store.delete_user(bob.user_id, 2.0)
    assert all(store.lookup_key(key_digest(k), 3.0) is None for k in keys)
    assert all(k.revoked_s is not None for k in store.keys_of(bob.user_id))
    assert [u.name for u in store.users()] == ["root"]
    assert store.user_by_name("bob") is None
    store.create_user("bob", "scrypt$x", "user")  # the name is free again
    with pytest.raises(IdentityError, match="no such user"):
        store.set_role(bob.user_id, "admin")


def test_role_changes_end_sessions_and_the_last_active_admin_stays(store: IdentityStore) -> None:
    root = store.create_user("root", "scrypt$x", "admin")
    cookie, _ = store.create_session(root, 1.0)
    for change in (lambda: store.set_role(root.user_id, "user"), lambda: store.set_disabled(root.user_id, True, 2.0),
                   lambda: store.delete_user(root.user_id, 2.0)):
        with pytest.raises(IdentityError, match="last active admin"):
            change()
    assert store.session(cookie, 2.0) is not None  # nothing changed
    amy = store.create_user("amy", "scrypt$x", "user")
    assert store.set_role(amy.user_id, "admin").role == "admin"
    assert store.set_role(root.user_id, "user").role == "user"
    assert store.session(cookie, 3.0) is None  # a page signed in as admin does not linger as one


def test_a_user_row_from_a_gateway_before_user_management_still_applies(store: IdentityStore) -> None:
    row = {"user_id": "u_old", "name": "old", "role": "user", "pw_hash": "scrypt$x", "created_s": 1.0,
           "updated_s": time.time() + 10}
    assert store.apply_replica("users", row)
    assert store.user("u_old") is not None and not store.user("u_old").disabled  # type: ignore[union-attr]
    store.apply_replica("users", {**row, "disabled_s": 5.0, "deleted_s": None, "updated_s": row["updated_s"] + 1})
    assert store.user("u_old").disabled  # type: ignore[union-attr]


def _cli(tmp_path: Path, *argv: str) -> None:
    admin_cli.main([*argv, "--data-dir", str(tmp_path)])


def test_the_cli_revokes_any_key_and_manages_users(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = IdentityStore(tmp_path / "identity")
    s.create_user("root", "scrypt$x", "admin")
    bob = s.create_user("bob", "scrypt$x", "user")
    key, record = s.create_key(bob.user_id, "k", None, 0.0)
    s.close()
    _cli(tmp_path, "revoke-key", record.key_id)
    _cli(tmp_path, "set-role", "bob", "admin")
    _cli(tmp_path, "disable-user", "bob")
    _cli(tmp_path, "list-users")
    assert "bob\tadmin\tdisabled" in capsys.readouterr().out
    _cli(tmp_path, "enable-user", "bob")
    _cli(tmp_path, "delete-user", "root")
    with pytest.raises(SystemExit) as info:
        _cli(tmp_path, "delete-user", "bob")  # the last active admin now
    assert info.value.code == 2 and "last active admin" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _cli(tmp_path, "disable-user", "nobody")
    s = IdentityStore(tmp_path / "identity")
    try:
        assert s.lookup_key(key_digest(key), time.time()) is None
        assert [(u.name, u.role, u.disabled) for u in s.users()] == [("bob", "admin", False)]
    finally:
        s.close()
