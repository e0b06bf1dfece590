"""``llmgw admin set-limits`` / ``limits`` run in-process on a real identity database in tmp_path, and a
store that stays open (as a running gateway's does) sees their changes at its next ``refresh()``."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.gateway import admin_cli
from services.gateway.identity import IdentityStore
from services.gateway.limits import Limits, key_principal, user_principal


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """User carol with one key, "batch"."""
    store = IdentityStore(tmp_path / "identity")
    try:
        user = store.create_user("carol", "scrypt$unused", "user")
        store.create_key(user.user_id, "batch", None, 0.0)
    finally:
        store.close()
    return tmp_path


def _open(data: Path) -> IdentityStore:
    return IdentityStore(data / "identity")


def _ids(data: Path) -> tuple[str, str]:
    """carol's user id and her key's id."""
    store = _open(data)
    try:
        user = next(u for u in store.users() if u.name == "carol")
        return user.user_id, store.keys_of(user.user_id)[0].key_id
    finally:
        store.close()


def _cli(data: Path, *argv: str) -> None:
    admin_cli.main([*argv, "--data-dir", str(data)])


def _user_limits(data: Path) -> Limits:
    user_id, _ = _ids(data)
    store = _open(data)
    try:
        return store.limits_of(user_principal(user_id))
    finally:
        store.close()


def test_set_limits_changes_only_the_flags_given_and_none_removes_one(
        data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _cli(data, "set-limits", "--user", "carol", "--requests-per-minute", "60", "--usd-per-month", "12.5")
    assert _user_limits(data) == Limits(requests_per_minute=60, usd_per_month=12.5)
    out = capsys.readouterr().out
    assert "limits of user 'carol': tokens_per_day none, requests_per_minute 60" in out
    assert "applies the change within 15 s" in out
    _cli(data, "set-limits", "--user", "carol", "--tokens-per-day", "1,000,000", "--kwh-per-month", "0.5")
    assert _user_limits(data) == Limits(tokens_per_day=1_000_000, requests_per_minute=60, usd_per_month=12.5,
                                        kwh_per_month=0.5)
    _cli(data, "set-limits", "--user", "carol", "--requests-per-minute", "none", "--usd-per-month", "none")
    assert _user_limits(data) == Limits(tokens_per_day=1_000_000, kwh_per_month=0.5)


def test_a_keys_tokens_per_day_is_its_daily_quota_and_the_rest_binds_its_lineage(data: Path) -> None:
    _, key_id = _ids(data)
    _cli(data, "set-limits", "--key", key_id, "--tokens-per-day", "5000", "--tokens-per-minute", "900")
    store = _open(data)
    try:
        key = store.key_by_id(key_id)
        assert key is not None and key.daily_quota == 5000
        assert store.limits_of(key_principal(key_id)) == Limits(tokens_per_minute=900)  # no tokens_per_day row
        assert store.key_limits(key) == Limits(tokens_per_day=5000, tokens_per_minute=900)
        _, new = store.rotate_key(key_id, 3600.0, 1.0)  # the new key carries the quota and the lineage's limits
        assert new.lineage == key_id
        assert store.key_limits(new) == Limits(tokens_per_day=5000, tokens_per_minute=900)
        new_id = new.key_id
    finally:
        store.close()
    _cli(data, "set-limits", "--key", new_id, "--tokens-per-minute", "100")  # set on the new key: the lineage's
    store = _open(data)
    try:
        assert store.limits_of(key_principal(key_id)) == Limits(tokens_per_minute=100)
    finally:
        store.close()


def test_limits_prints_a_header_then_each_user_and_each_usable_key(
        data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    user_id, key_id = _ids(data)
    _cli(data, "set-limits", "--user", "carol", "--requests-per-minute", "60", "--kwh-per-month", "2.25")
    _cli(data, "set-limits", "--key", key_id, "--tokens-per-day", "7000")
    capsys.readouterr()
    _cli(data, "limits")
    lines = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert lines == [
        ["principal", "user", "key_id", "tokens_per_day", "requests_per_minute", "tokens_per_minute", "usd_per_month",
         "kwh_per_month"],
        [f"user-{user_id}", "carol", "-", "none", "60", "none", "none", "2.25"],
        [f"key-{key_id}", "carol", key_id, "7000", "none", "none", "none", "none"],
    ]


@pytest.mark.parametrize(("argv", "flag"), [
    (["--user", "carol", "--requests-per-minute", "0"], "--requests-per-minute"),
    (["--user", "carol", "--tokens-per-day", "1.5"], "--tokens-per-day"),
    (["--user", "carol", "--usd-per-month", "-3"], "--usd-per-month"),
    (["--user", "carol", "--kwh-per-month", "lots"], "--kwh-per-month"),
    (["--user", "carol", "--kwh-per-month", "inf"], "--kwh-per-month"),
    (["--user", "nobody", "--requests-per-minute", "5"], "--user"),
    (["--key", "key_nope", "--requests-per-minute", "5"], "--key"),
    (["--user", "carol"], "set-limits"),  # no limit flag: nothing to do
    (["--requests-per-minute", "5"], "--user"),  # whose limits?
    (["--user", "carol", "--key", "KEY", "--requests-per-minute", "5"], "--key"),  # not both
])
def test_set_limits_refuses_bad_input_naming_the_flag_and_changes_nothing(
        data: Path, argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    _, key_id = _ids(data)
    with pytest.raises(SystemExit) as info:
        _cli(data, "set-limits", *[key_id if a == "KEY" else a for a in argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "llmgw admin" in err and flag in err
    assert _user_limits(data) == Limits()
    store = _open(data)
    try:
        key = store.key_by_id(key_id)
        assert key is not None and store.key_limits(key) == Limits()
    finally:
        store.close()


def test_an_open_store_sees_limits_set_from_the_shell_at_its_next_refresh(data: Path) -> None:
    user_id, key_id = _ids(data)
    running = _open(data)  # a running gateway's store: it keeps keys and limits in memory
    try:
        _cli(data, "set-limits", "--user", "carol", "--requests-per-minute", "30")
        _cli(data, "set-limits", "--key", key_id, "--tokens-per-day", "800", "--usd-per-month", "4")
        assert running.limits_of(user_principal(user_id)) == Limits()  # not reread yet
        running.refresh()  # what the gateway does every 15 s (identity_sync.RESYNC_S)
        assert running.limits_of(user_principal(user_id)) == Limits(requests_per_minute=30)
        key = running.key_by_id(key_id)
        assert key is not None and running.key_limits(key) == Limits(tokens_per_day=800, usd_per_month=4.0)
        user_limits, key_limits = (p.limits for p in running.principals_of(key))
        assert (user_limits.requests_per_minute, key_limits.tokens_per_day) == (30, 800)
    finally:
        running.close()
