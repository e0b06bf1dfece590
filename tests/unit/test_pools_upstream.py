"""A pools file written for the Go llm-gateway loads here (issue #24): every key with a meaning keeps its
upstream semantics, every other key is one "ignored (why)" warning, never a refusal."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from proto.pools import ConfigError, load, parse, to_dict

# The shape of the Go gateway's own full-config test and of its SPEC §10 (keys, zero values and all).
UPSTREAM = {
    "gateway": {"port": 8035, "trust_local_networks": True, "models_require_auth": False,
                "api_keys_file": "/etc/llm-inference/api-keys.list", "users_file": "/var/lib/llmgw/users.json",
                "usage_file": "/var/lib/llmgw/usage.json", "public_base_url": "https://llm.example.com"},
    "discovery": {"local_ports": [8000], "remote_host": "192.168.1.100", "remote_ports": [8006]},
    "local_networks": ["192.168.1.0/24", "10.0.0.0/8"],
    "metrics": {"poll_interval": 10, "stale_threshold": 30, "default_max_seqs": 3,
                "ninfer_lane_weight": 0.75, "ninfer_queue_weight": 0.15, "ninfer_pressure_weight": 0.1,
                "backend_max_seqs": {"http://127.0.0.1:8000": 6}},
    "backend_max_seqs": {"http://192.168.1.100:8006/": 12},
    "model_pools": {"qwen": {
        "members": [
            {"model_id": "qwen-a", "backend": "http://127.0.0.1:8000", "max_context": 0, "capacity_weight": 0},
            {"model_id": "qwen-b", "backend": "http://192.168.1.100:8006", "large_context": True,
             "capacity_weight": 8},
        ],
        "overflow_threshold": 0.2, "sticky_bias": 0.05, "large_prompt_tokens": 48000, "capacity_bias": 0.15,
        "cache_affinity": True, "max_pool_share": 0, "aliases": ["q"]}},
    "overflow_pairs": {"qwen-a": {"fallback_model_id": "qwen-b", "fallback_backend": "http://192.168.1.100:8006"}},
    "public_models": ["qwen"],
    "hosts": [{"label": "box1", "ips": ["192.168.1.100"], "overhead_watts": 80, "gpus": [{"name": "4090"}]}],
    "cache": {"ttl": 60},
    "electricity_rate_usd_per_kwh": 0.15,
    "price_book": {"prompt_usd_per_m": 0.2, "cached_usd_per_m": 0.05, "output_usd_per_m": 0.8},
}


def test_a_full_upstream_file_loads_with_its_meaning_and_one_warning_per_ignored_key(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "llm_gateway.conf"
    path.write_text(json.dumps(UPSTREAM))
    with caplog.at_level(logging.WARNING, logger="proto.pools"):
        cfg = load(path)
    pool = cfg.pools["qwen"]
    a, b = pool.members
    assert a.max_context is None  # 0: the engine's own value
    assert a.capacity_weight == 0  # 0: the member's lanes are its weight (routing_adapter)
    assert pool.max_pool_share == 0  # off
    assert (pool.overflow_threshold, pool.sticky_bias, pool.capacity_bias) == (0.2, 0.05, 0.15)
    assert cfg.metrics.max_seqs_for(a) == 6 and cfg.metrics.max_seqs_for(b) == 12  # URL keys, both places
    assert cfg.metrics.default_lanes == 3 and cfg.metrics.stale_threshold == 30
    assert cfg.limits.port == 8035 and cfg.limits.trust_local_networks
    assert cfg.local_networks == ("192.168.1.0/24", "10.0.0.0/8")
    assert cfg.price_book["*"].output_usd_per_m == 0.8  # flat: every model's price
    lines = [r.getMessage() for r in caplog.records]
    ignored = sorted(line.split(":")[0].removeprefix("config ") for line in lines if "ignored (" in line)
    assert ignored == sorted([
        "cache", "discovery", "hosts", "overflow_pairs", "public_models", "gateway.api_keys_file",
        "gateway.usage_file", "gateway.users_file", "gateway.public_base_url",
        "model_pools.qwen.large_prompt_tokens", "model_pools.qwen.members[1].large_context"])
    assert all(line.count("\n") == 0 for line in lines)


def test_the_saved_form_of_an_upstream_file_parses_to_the_same_config() -> None:
    cfg = parse(json.loads(json.dumps(UPSTREAM)))
    assert parse(to_dict(cfg)) == cfg


def test_a_member_max_seqs_beats_backend_max_seqs_and_zero_means_unset() -> None:
    raw = {"model_pools": {"p": {"members": [
        {"model_id": "m", "backend": "http://h:1", "max_seqs": 32}, {"model_id": "m", "backend": "http://h:2"}]}},
        "metrics": {"backend_max_seqs": {"http://h:1": 4, "http://h:2": 0}, "default_max_seqs": 0}}
    cfg = parse(raw)
    one, two = cfg.pools["p"].members
    assert cfg.metrics.max_seqs_for(one) == 32
    assert cfg.metrics.max_seqs_for(two) is None and cfg.metrics.default_lanes == 3


def test_keys_neither_ours_nor_upstream_are_still_refused() -> None:
    with pytest.raises(ConfigError, match="discovery_typo"):
        parse({"discovery_typo": {}})
    with pytest.raises(ConfigError, match=r"gateway\.prot"):
        parse({"gateway": {"prot": 1}})
    with pytest.raises(ConfigError, match="backend_max_seqs"):
        parse({"backend_max_seqs": [1]})
