import json
from pathlib import Path

import pytest

from services.common.pool_config import load, member_id_for, parse
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
    (lambda c: c["model_pools"]["qwen3.8-27b"]["members"][1].update(capacity_weight=0),
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
