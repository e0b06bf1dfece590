"""A member's key in the pools file (proto/pools.py): ``api_key_env`` read at parse, a literal ``api_key``
warned about at load, either one kept out of reprs, and every bad value a ConfigError naming its key."""

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from proto.pools import MemberConfig, load, parse, to_dict
from services.common.runtime import ConfigError
from services.gateway import config_form

ENV = "LLMGW_TEST_POOLS_KEY"
SECRET = "sk-unit-secret-93b1"


def _file(**member: Any) -> dict[str, Any]:
    return {"model_pools": {"p": {"members": [{"model_id": "m", "backend": "http://gpu1:8000", **member}]}}}


def _member(**member: Any) -> MemberConfig:
    return parse(_file(**member)).pools["p"].members[0]


def test_api_key_env_is_read_when_parsed_and_only_its_name_is_written_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, SECRET)
    config = parse(_file(api_key_env=ENV))
    member = config.pools["p"].members[0]
    assert (member.api_key_env, member.api_key) == (ENV, SECRET)
    written = to_dict(config)["model_pools"]["p"]["members"][0]
    assert written["api_key_env"] == ENV and "api_key" not in written
    assert SECRET not in json.dumps(to_dict(config))
    assert parse(to_dict(config)) == config


@pytest.mark.parametrize("value", [None, ""], ids=["unset", "empty"])
def test_an_unset_or_empty_api_key_env_is_an_error_naming_the_members_key(
        monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    with pytest.raises(ConfigError) as caught:
        parse(_file(api_key_env=ENV))
    assert caught.value.key == "model_pools.p.members[0].api_key_env"
    assert ENV in caught.value.reason


@pytest.mark.parametrize(("member", "key"), [
    ({"api_key_env": "1-not-a-name"}, "model_pools.p.members[0].api_key_env"),
    ({"api_key": ""}, "model_pools.p.members[0].api_key"),
    ({"api_key": 5}, "model_pools.p.members[0].api_key"),
    ({"api_key": "a", "api_key_env": "HOME"}, "model_pools.p.members[0].api_key"),
    ({"api_key": "a", "backend": "http://u:pw@gpu1:8000"}, "model_pools.p.members[0].api_key"),
    ({"api_key": "a", "backend": "bus:w1"}, "model_pools.p.members[0].api_key"),
    ({"api_key_env": "HOME", "backend": "bus:*"}, "model_pools.p.members[0].api_key_env"),
])
def test_bad_credentials_are_errors_naming_the_key(member: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse(_file(**member))
    assert caught.value.key == key


def test_a_literal_api_key_is_kept_warned_about_at_load_and_masked_in_reprs(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "pools.json"
    path.write_text(json.dumps(_file(api_key=SECRET)))
    with caplog.at_level(logging.WARNING, logger="proto.pools"):
        config = load(path)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "model_pools.p.members[0].api_key" in warnings[0]
    assert SECRET not in warnings[0]
    assert config.pools["p"].members[0].api_key == SECRET
    assert to_dict(config)["model_pools"]["p"]["members"][0]["api_key"] == SECRET  # the file keeps what it held
    assert SECRET not in repr(config) and SECRET not in str(config.pools["p"].members[0])


def test_a_member_without_a_key_writes_no_key() -> None:
    member = to_dict(parse(_file()))["model_pools"]["p"]["members"][0]
    assert "api_key" not in member and "api_key_env" not in member and _member().api_key is None


def test_the_config_page_neither_shows_nor_drops_a_members_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, SECRET)
    current = to_dict(parse(_file(api_key_env=ENV, id="gpu1")))
    assert SECRET not in json.dumps(config_form.view_model(current))
    assert ENV not in json.dumps(config_form.view_model(current))
    form = {"pool.0.name": "p", "pool.0.member.0.backend": "http://gpu1:8000", "pool.0.member.0.model_id": "m",
            "pool.0.member.0.capacity_weight": "2", "pool.0.member.0.id": "gpu1",
            "pool.0.member.new.backend": "http://gpu2:8000", "pool.0.member.new.model_id": "m"}
    saved = config_form.from_form(form, current).raw
    first, added = saved["model_pools"]["p"]["members"]
    assert first["api_key_env"] == ENV and first["capacity_weight"] == 2.0
    assert "api_key_env" not in added and "api_key" not in added
    assert parse(saved).pools["p"].members[0].api_key == SECRET
