"""Setting a key's daily token quota: the form field's rules (identity.parse_daily_quota) and
``llmgw admin set-quota`` / ``list-keys`` run in-process on a real identity database in tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.gateway import admin_cli
from services.gateway.identity import MAX_DAILY_QUOTA, IdentityError, IdentityStore, parse_daily_quota


@pytest.mark.parametrize(("text", "quota"), [("", None), ("  ", None), ("1", 1), (" 12000 ", 12_000),
                                             ("1,000", 1_000), ("2_500", 2_500), (str(MAX_DAILY_QUOTA), 10**12)])
def test_a_quota_field_is_empty_for_none_or_a_whole_number_of_tokens(text: str, quota: int | None) -> None:
    assert parse_daily_quota(text) == quota


@pytest.mark.parametrize(("text", "reason"), [
    ("-5", "must not be negative"), ("0", "must be at least 1 token"), ("1.5", "whole number"),
    ("1e6", "whole number"), ("ten", "whole number"), ("²", "whole number"),  # a digit to str.isdigit, not to int
    (str(MAX_DAILY_QUOTA + 1), "at most 1,000,000,000,000"),
])
def test_a_bad_quota_field_is_refused_with_the_reason(text: str, reason: str) -> None:
    with pytest.raises(IdentityError) as info:
        parse_daily_quota(text)
    assert info.value.field == "daily_quota" and reason in info.value.message


def _store_with_a_key(data: Path) -> str:
    store = IdentityStore(data / "identity")
    try:
        user = store.create_user("carol", "scrypt$unused", "user")
        return store.create_key(user.user_id, "batch", None, 0.0)[1].key_id
    finally:
        store.close()


def _quota_in(data: Path, key_id: str) -> int | None:
    store = IdentityStore(data / "identity")
    try:
        key = store.key_by_id(key_id)
        assert key is not None
        return key.daily_quota
    finally:
        store.close()


def test_set_quota_sets_and_clears_a_keys_quota(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key_id = _store_with_a_key(tmp_path)
    admin_cli.main(["set-quota", key_id, "50,000", "--data-dir", str(tmp_path)])
    assert _quota_in(tmp_path, key_id) == 50_000
    assert f"daily quota of {key_id} set to 50,000 tokens per UTC day" in capsys.readouterr().out
    admin_cli.main(["list-keys", "--user", "carol", "--data-dir", str(tmp_path)])
    fields = capsys.readouterr().out.rstrip("\n").split("\t")  # id, user, name, hint, quota, status
    assert fields[:3] == [key_id, "carol", "batch"] and fields[3].startswith("sk-…")
    assert fields[4:] == ["50000", "active"]
    admin_cli.main(["set-quota", key_id, "none", "--data-dir", str(tmp_path)])
    assert _quota_in(tmp_path, key_id) is None


@pytest.mark.parametrize("argv", [["set-quota", "KEY", "0"], ["set-quota", "KEY", "-1"], ["set-quota", "KEY", "lots"],
                                  ["set-quota", "key_nope", "10"]])
def test_set_quota_refuses_bad_input_and_changes_nothing(tmp_path: Path, argv: list[str],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    key_id = _store_with_a_key(tmp_path)
    argv = [key_id if a == "KEY" else a for a in argv]
    with pytest.raises(SystemExit) as info:
        admin_cli.main([*argv, "--data-dir", str(tmp_path)])
    assert info.value.code == 2
    assert "llmgw admin" in capsys.readouterr().err
    assert _quota_in(tmp_path, key_id) is None
