"""The pools file (proto/pools.py): what parses, its defaults, and every bad value a ConfigError naming its key."""

import json
from pathlib import Path

import pytest

from proto.pools import GatewayFileConfig, change_message, load, member_id_for, parse, read_change_message, to_dict
from services.common.runtime import ConfigError

GOOD = {
    "model_pools": {
        "qwen3.8-27b": {
            "members": [
                {"model_id": "qwen3.8-27b", "backend": "http://gpu1:8006", "capacity_weight": 8},
                {"model_id": "qwen3.8-27b", "backend": "bus:gpu2-engine", "max_context": 32768},
            ],
            "cache_affinity": True,
            "aliases": ["qwen"],
        }
    },
    "price_book": {"qwen3.8-27b": {"prompt_usd_per_m": 0.2, "output_usd_per_m": 0.8}},
    "metrics": {"stale_threshold": 2.5},
}


def test_the_interop_pool_shape_parses_with_defaults_and_aliases() -> None:
    cfg = parse(GOOD)
    pool = cfg.pool_for("qwen")
    assert pool is not None and pool is cfg.pool_for("qwen3.8-27b")
    http, bus = pool.members
    assert (http.member_id, http.is_http, http.capacity_weight) == ("http-gpu1-8006", True, 8.0)
    assert (bus.member_id, bus.bus_worker, bus.max_context) == ("gpu2-engine", "gpu2-engine", 32768)
    assert pool.overflow_threshold == 0.95 and cfg.metrics.stale_threshold == 2.5  # the default (docs/routing.md §3)
    assert cfg.price_book["qwen3.8-27b"].output_usd_per_m == 0.8
    assert [m.member_id for m in cfg.http_members()] == ["http-gpu1-8006"]


@pytest.mark.parametrize(("mutate", "key"), [
    (lambda c: c["model_pools"]["qwen3.8-27b"].update(bogus=1), "model_pools.qwen3.8-27b.bogus"),
    (lambda c: c["model_pools"]["qwen3.8-27b"]["members"][0].update(backend="ftp://x"),
     "model_pools.qwen3.8-27b.members[0].backend"),
    (lambda c: c["model_pools"]["qwen3.8-27b"]["members"][0].update(backend="http://h:notaport"),
     "model_pools.qwen3.8-27b.members[0].backend"),
    (lambda c: c["model_pools"]["qwen3.8-27b"].update(overflow_threshold=1.5),
     "model_pools.qwen3.8-27b.overflow_threshold"),
    (lambda c: c["model_pools"]["qwen3.8-27b"].update(sticky_bias=-0.1), "model_pools.qwen3.8-27b.sticky_bias"),
    (lambda c: c["model_pools"]["qwen3.8-27b"]["members"][1].update(capacity_weight=-1),
     "model_pools.qwen3.8-27b.members[1].capacity_weight"),
    (lambda c: c["metrics"].update(ninfer_lane_weight=2), "metrics.ninfer_lane_weight"),
    (lambda c: c.update(extra=True), "extra"),
    (lambda c: c["model_pools"]["qwen3.8-27b"]["members"].append(
        {"model_id": "q", "backend": "http://gpu1:8006"}), "model_pools.qwen3.8-27b.members"),
])
def test_bad_values_are_errors_naming_the_key(mutate, key: str) -> None:  # type: ignore[no-untyped-def]
    cfg = json.loads(json.dumps(GOOD))
    mutate(cfg)
    with pytest.raises(ConfigError) as info:
        parse(cfg)
    assert info.value.key == key


def test_a_file_that_is_not_json_says_where(tmp_path: Path) -> None:
    path = tmp_path / "gw.json"
    path.write_text('{"model_pools": {,}}')
    with pytest.raises(ConfigError, match="line 1 column"):
        load(path)


def test_member_ids_are_subject_safe_and_stable() -> None:
    assert member_id_for("https://api.example.com/v1") == "http-api-example-com-443-v1"
    assert member_id_for("bus:w-1") == "w-1"


@pytest.mark.parametrize(("mutate", "key"), [
    (lambda c: c["model_pools"]["qwen3.8-27b"].update(overflow_threshold=float("nan")),
     "model_pools.qwen3.8-27b.overflow_threshold"),  # NaN passes no bound
    (lambda c: c.update(electricity_rate_usd_per_kwh=float("inf")), "electricity_rate_usd_per_kwh"),
    (lambda c: c.update(electricity_rate_usd_per_kwh=10**400), "electricity_rate_usd_per_kwh"),  # no float holds it
    (lambda c: c.update(gateway={"max_body_bytes": 10**400}), "gateway.max_body_bytes"),
    (lambda c: c.update(gateway={"max_body_bytes": "4MiB"}), "gateway.max_body_bytes"),
    (lambda c: c.update(gateway=[1, 2]), "gateway"),
    (lambda c: c.update(metrics=None), "metrics"),
    (lambda c: c.update(model_pools=["qwen"]), "model_pools"),
    (lambda c: c.update(price_book={"m": 3}), "price_book.m"),
    (lambda c: c["price_book"]["qwen3.8-27b"].update(prompt_usd_per_m=-0.1), "price_book.qwen3.8-27b.prompt_usd_per_m"),
    (lambda c: c["model_pools"]["qwen3.8-27b"].update(members=[[[[[]]]]]), "model_pools.qwen3.8-27b.members[0]"),
    (lambda c: c["model_pools"]["qwen3.8-27b"].update(members=[]), "model_pools.qwen3.8-27b.members"),
    (lambda c: c["model_pools"]["qwen3.8-27b"].update(name="other"), "model_pools.qwen3.8-27b.name"),  # key = name
    (lambda c: c["model_pools"]["qwen3.8-27b"].update(aliases=["qwen", ""]), "model_pools.qwen3.8-27b.aliases[1]"),
    (lambda c: c["model_pools"]["qwen3.8-27b"].update(aliases="qwen"), "model_pools.qwen3.8-27b.aliases"),
    (lambda c: c["model_pools"]["qwen3.8-27b"].update(cache_affinity="yes"), "model_pools.qwen3.8-27b.cache_affinity"),
    (lambda c: c["model_pools"]["qwen3.8-27b"]["members"][0].update(capacity_weight=True),
     "model_pools.qwen3.8-27b.members[0].capacity_weight"),  # a bool is not a number
    (lambda c: c["model_pools"]["qwen3.8-27b"]["members"][0].update(max_context=1.5),
     "model_pools.qwen3.8-27b.members[0].max_context"),
    (lambda c: c["model_pools"]["qwen3.8-27b"]["members"][0].update(backend=8006),
     "model_pools.qwen3.8-27b.members[0].backend"),
    (lambda c: c["model_pools"]["qwen3.8-27b"]["members"][0].update(backend="http://[::1"),
     "model_pools.qwen3.8-27b.members[0].backend"),
    (lambda c: c["model_pools"]["qwen3.8-27b"]["members"][0].update(backend="http://gpu1:8006/?x=1"),
     "model_pools.qwen3.8-27b.members[0].backend"),
    (lambda c: c["model_pools"]["qwen3.8-27b"]["members"][1].update(backend="bus:a.b"),
     "model_pools.qwen3.8-27b.members[1].backend"),
    (lambda c: c["model_pools"]["qwen3.8-27b"]["members"][0].update(id="gpu1\n"),
     "model_pools.qwen3.8-27b.members[0].id"),  # "$" would let the newline through
    (lambda c: c["model_pools"]["qwen3.8-27b"]["members"][0].pop("model_id"),
     "model_pools.qwen3.8-27b.members[0].model_id"),
    (lambda c: c["model_pools"]["qwen3.8-27b"]["members"][0].update(member_id="x"),
     "model_pools.qwen3.8-27b.members[0].member_id"),  # the file's key is "id"
    (lambda c: c["model_pools"]["qwen3.8-27b"]["members"].append({"model_id": "q.1", "backend": "bus:*"}),
     "model_pools.qwen3.8-27b.members[2].id"),  # the derived id "bus-q.1" is not subject-safe
    (lambda c: c.update({"x - at `$.metrics`": 1}), "x - at `$.metrics`"),  # a key that reads like msgspec's path
])
def test_hostile_values_are_config_errors_naming_the_key(mutate, key: str) -> None:  # type: ignore[no-untyped-def]
    cfg = json.loads(json.dumps(GOOD))
    mutate(cfg)
    with pytest.raises(ConfigError) as info:
        parse(cfg)
    assert info.value.key == key


def test_an_unknown_key_lists_the_allowed_ones_and_a_bad_value_is_shown() -> None:
    cfg = json.loads(json.dumps(GOOD))
    cfg["metrics"]["poll_intervall"] = 2.0
    with pytest.raises(ConfigError, match=r"metrics.poll_intervall: unknown key \(allowed: backend_max_seqs, "
                                          r"default_max_seqs, ninfer_lane_weight, "):
        parse(cfg)
    cfg = json.loads(json.dumps(GOOD))
    cfg["model_pools"]["qwen3.8-27b"]["overflow_threshold"] = 1.5
    with pytest.raises(ConfigError, match=r"overflow_threshold: must be in \[0.0, 1.0\], got 1.5$"):
        parse(cfg)


@pytest.mark.parametrize("text", [
    "[" * 100_000,  # nesting past the parser's recursion limit
    '{"electricity_rate_usd_per_kwh": ' + "1" * 5000 + "}",  # past Python's int-string limit
    '{"electricity_rate_usd_per_kwh": NaN}',
    "[]",
    "null",
])
def test_hostile_files_are_config_errors(tmp_path: Path, text: str) -> None:
    path = tmp_path / "gw.json"
    path.write_text(text)
    with pytest.raises(ConfigError):
        load(path)


def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "gw.json"
    path.write_bytes(b'\xff\xfe{"model_pools": {}}')
    with pytest.raises(ConfigError, match="cannot read"):
        load(path)


def test_every_default_is_written_once_in_the_structs() -> None:
    cfg = parse({})
    assert to_dict(cfg)["gateway"] == {"request_timeout_s": 600.0, "first_byte_timeout_s": 5.0,
                                        "max_body_bytes": 4 * 1024 * 1024, "max_concurrent_per_key": 64,
                                        "reserve_output_tokens": 1024}
    assert cfg == GatewayFileConfig() and parse(to_dict(parse(GOOD))) == parse(GOOD)


@pytest.mark.parametrize("data", [b"\xff\xfe", b"[1]", b"[" * 100_000, b'{"gateway_id": 1, "config": {}}',
                                  b'{"gateway_id": "g", "config": {"metrics": {"poll_interval": "fast"}}}'])
def test_a_hostile_config_changed_message_is_a_config_error(data: bytes) -> None:
    with pytest.raises(ConfigError):
        read_change_message(data)


def test_a_config_changed_message_round_trips() -> None:
    change = read_change_message(change_message("gw-1", GOOD))
    assert (change.gateway_id, change.raw, change.config) == ("gw-1", GOOD, parse(GOOD))


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_refused_for_every_numeric_knob_naming_it(text: str) -> None:
    """Issue #25: json.loads reads NaN/Infinity, and an unbounded knob (a price, a capacity weight) took them."""
    for where, raw in (("price_book.m.prompt_usd_per_m", '{"price_book": {"m": {"prompt_usd_per_m": %s}}}'),
                       ("model_pools.p.members[0].capacity_weight",
                        '{"model_pools": {"p": {"members": [{"model_id": "m", "backend": "http://h:1", '
                        '"capacity_weight": %s}]}}}'),
                       ("metrics.poll_interval", '{"metrics": {"poll_interval": %s}}')):
        with pytest.raises(ConfigError) as info:
            parse(json.loads(raw % text))
        assert info.value.key == where and "finite" in info.value.reason
