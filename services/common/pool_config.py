"""The pools file shared by the gateway (routing) and telemetry (which HTTP members to scrape).

    {
      "model_pools": {
        "qwen3.8-27b": {
          "members": [
            {"model_id": "qwen3.8-27b", "backend": "http://gpu1:8006", "capacity_weight": 8},
            {"model_id": "qwen3.8-27b", "backend": "bus:gpu2-engine", "capacity_weight": 8, "max_context": 32768}
          ],
          "cache_affinity": true, "overflow_threshold": 0.95, "sticky_bias": 0.2, "capacity_bias": 0.1,
          "aliases": ["qwen"]
        }
      },
      "electricity_rate_usd_per_kwh": 0.125,
      "price_book": {"qwen3.8-27b": {"prompt_usd_per_m": 0.2, "cached_usd_per_m": 0.05, "output_usd_per_m": 0.8}},
      "metrics": {"poll_interval": 1.0, "stale_threshold": 3.0,
                  "ninfer_lane_weight": 0.75, "ninfer_queue_weight": 0.15, "ninfer_pressure_weight": 0.10},
      "gateway": {"request_timeout_s": 600, "first_byte_timeout_s": 5, "max_body_bytes": 4194304}
    }

A member's ``backend`` is an ``http(s)://`` URL (any OpenAI-compatible server), ``bus:<worker_id>`` (one of
our engines on the bus), or ``bus:*`` (every bus worker serving the member's ``model_id``). Engines on the
bus that no pool names are offered under their own model id (discovery).

Validation is strict: unknown keys, wrong types, bad URLs and out-of-range weights are errors that name
the key path (``model_pools.qwen.members[1].backend: …``). A broken file at reload keeps the old config.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from proto.admin import ConfigChanged
from proto.codec import ProtoDecodeError, decode_json, encode_json
from services.common.runtime import ConfigError

_ID_SAFE = re.compile(r"[^A-Za-z0-9_-]+")


@dataclass(frozen=True)
class MemberConfig:
    member_id: str
    model_id: str
    backend: str  # http(s) URL, "bus:<worker_id>" or "bus:*"
    capacity_weight: float = 1.0
    max_context: int | None = None

    @property
    def is_http(self) -> bool:
        return self.backend.startswith(("http://", "https://"))

    @property
    def bus_worker(self) -> str | None:
        """The worker id for ``bus:<id>``, ``"*"`` for ``bus:*``, None for HTTP members."""
        return self.backend.removeprefix("bus:") if self.backend.startswith("bus:") else None


@dataclass(frozen=True)
class PoolConfig:
    name: str
    members: tuple[MemberConfig, ...]
    cache_affinity: bool = True
    overflow_threshold: float = 0.95
    sticky_bias: float = 0.2
    capacity_bias: float = 0.1
    max_pool_share: float = 1.0
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class Prices:
    prompt_usd_per_m: float = 0.0
    cached_usd_per_m: float = 0.0
    output_usd_per_m: float = 0.0


@dataclass(frozen=True)
class MetricsConfig:
    poll_interval: float = 1.0
    stale_threshold: float = 3.0
    ninfer_lane_weight: float = 0.75
    ninfer_queue_weight: float = 0.15
    ninfer_pressure_weight: float = 0.10


@dataclass(frozen=True)
class Limits:
    request_timeout_s: float = 600.0
    first_byte_timeout_s: float = 5.0
    max_body_bytes: int = 4 * 1024 * 1024
    max_concurrent_per_key: int = 64
    # what a limit reservation counts for a request without max_tokens (docs/admin.md, "Limits")
    reserve_output_tokens: int = 1024


@dataclass(frozen=True)
class GatewayFileConfig:
    pools: dict[str, PoolConfig] = field(default_factory=dict)
    electricity_rate_usd_per_kwh: float = 0.125
    price_book: dict[str, Prices] = field(default_factory=dict)
    metrics: MetricsConfig = MetricsConfig()
    limits: Limits = Limits()

    def pool_for(self, model: str) -> PoolConfig | None:
        """The pool a client's model name (pool name or alias) refers to."""
        if model in self.pools:
            return self.pools[model]
        for pool in self.pools.values():
            if model in pool.aliases:
                return pool
        return None

    def http_members(self) -> list[MemberConfig]:
        seen: dict[str, MemberConfig] = {}
        for pool in self.pools.values():
            for m in pool.members:
                if m.is_http:
                    seen.setdefault(m.member_id, m)
        return list(seen.values())


def _check_keys(obj: dict[str, Any], allowed: set[str], path: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ConfigError(f"{path}.{unknown[0]}" if path else unknown[0],
                          f"unknown key (allowed: {', '.join(sorted(allowed))})")


def _obj(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(path, f"must be an object, got {type(value).__name__}")
    return value


def _num(obj: dict[str, Any], key: str, path: str, default: float, lo: float | None = None,
         hi: float | None = None, lo_open: bool = False) -> float:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{path}.{key}", f"must be a number, got {value!r}")
    if (lo is not None and (value < lo or (lo_open and value == lo))) or (hi is not None and value > hi):
        bounds = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else '∞'}]"
        raise ConfigError(f"{path}.{key}", f"must be in {bounds}, got {value}")
    return float(value)


def member_id_for(backend: str) -> str:
    """A stable, subject-safe id for a member: the worker id for bus members, host-port for URLs."""
    if backend.startswith("bus:"):
        return backend.removeprefix("bus:")
    parts = urlsplit(backend)
    return _ID_SAFE.sub("-", f"http-{parts.hostname}-{parts.port or (443 if parts.scheme == 'https' else 80)}"
                             f"{parts.path.rstrip('/')}").strip("-")


def _member(raw: Any, path: str) -> MemberConfig:
    m = _obj(raw, path)
    _check_keys(m, {"model_id", "backend", "capacity_weight", "max_context", "id"}, path)
    model_id = m.get("model_id")
    if not isinstance(model_id, str) or not model_id:
        raise ConfigError(f"{path}.model_id", "required, a non-empty string")
    backend = m.get("backend")
    if not isinstance(backend, str):
        raise ConfigError(f"{path}.backend", "required: an http(s):// URL, bus:<worker_id> or bus:*")
    if backend.startswith(("http://", "https://")):
        parts = urlsplit(backend)
        if not parts.hostname or parts.query or parts.fragment:
            raise ConfigError(f"{path}.backend", f"not a usable base URL: {backend!r}")
        try:
            _ = parts.port  # raises ValueError on a bad port
        except ValueError:
            raise ConfigError(f"{path}.backend", f"bad port in {backend!r}") from None
    elif backend.startswith("bus:"):
        worker = backend.removeprefix("bus:")
        if worker != "*" and not re.fullmatch(r"[A-Za-z0-9_-]{1,128}", worker):
            raise ConfigError(f"{path}.backend", f"bus worker id must be [A-Za-z0-9_-] or *, got {worker!r}")
    else:
        raise ConfigError(f"{path}.backend", f"must be an http(s):// URL, bus:<worker_id> or bus:*, got {backend!r}")
    max_context = m.get("max_context")
    if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int)
                                    or max_context < 1):
        raise ConfigError(f"{path}.max_context", f"must be a positive integer, got {max_context!r}")
    member_id = m.get("id", member_id_for(backend) if backend != "bus:*" else f"bus-{model_id}")
    if not isinstance(member_id, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,128}", member_id):
        raise ConfigError(f"{path}.id", f"must be 1-128 of [A-Za-z0-9_-], got {member_id!r}")
    return MemberConfig(member_id=member_id, model_id=model_id, backend=backend.rstrip("/"),
                        capacity_weight=_num(m, "capacity_weight", path, 1.0, lo=0.0, lo_open=True),
                        max_context=max_context)


def _pool(name: str, raw: Any, path: str) -> PoolConfig:
    p = _obj(raw, path)
    _check_keys(p, {"members", "cache_affinity", "overflow_threshold", "sticky_bias", "capacity_bias",
                    "max_pool_share", "aliases"}, path)
    members_raw = p.get("members")
    if not isinstance(members_raw, list) or not members_raw:
        raise ConfigError(f"{path}.members", "required: a non-empty array of members")
    members = tuple(_member(m, f"{path}.members[{i}]") for i, m in enumerate(members_raw))
    ids = [m.member_id for m in members]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"{path}.members", f"member {dupes[0]!r} is listed twice")
    aliases = p.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise ConfigError(f"{path}.aliases", "must be an array of non-empty strings")
    affinity = p.get("cache_affinity", True)
    if not isinstance(affinity, bool):
        raise ConfigError(f"{path}.cache_affinity", "must be true or false")
    return PoolConfig(
        name=name, members=members, cache_affinity=affinity,
        overflow_threshold=_num(p, "overflow_threshold", path, 0.95, 0.0, 1.0),
        sticky_bias=_num(p, "sticky_bias", path, 0.2, 0.0, 1.0),
        capacity_bias=_num(p, "capacity_bias", path, 0.1, 0.0, 1.0),
        max_pool_share=_num(p, "max_pool_share", path, 1.0, 0.0, 1.0, lo_open=True),
        aliases=tuple(aliases),
    )


def parse(data: Any) -> GatewayFileConfig:
    root = _obj(data, "config")
    _check_keys(root, {"model_pools", "electricity_rate_usd_per_kwh", "price_book", "metrics", "gateway"}, "")
    pools_raw = _obj(root.get("model_pools", {}), "model_pools")
    pools = {name: _pool(name, raw, f"model_pools.{name}") for name, raw in pools_raw.items()}
    names: dict[str, str] = {}
    for pool in pools.values():
        for alias in (pool.name, *pool.aliases):
            if alias in names and names[alias] != pool.name:
                raise ConfigError(f"model_pools.{pool.name}.aliases", f"{alias!r} already names pool {names[alias]!r}")
            names[alias] = pool.name
    prices: dict[str, Prices] = {}
    for model, raw in _obj(root.get("price_book", {}), "price_book").items():
        path = f"price_book.{model}"
        entry = _obj(raw, path)
        _check_keys(entry, {"prompt_usd_per_m", "cached_usd_per_m", "output_usd_per_m"}, path)
        prices[model] = Prices(*(_num(entry, k, path, 0.0, 0.0) for k in
                                 ("prompt_usd_per_m", "cached_usd_per_m", "output_usd_per_m")))
    m = _obj(root.get("metrics", {}), "metrics")
    _check_keys(m, {"poll_interval", "stale_threshold", "ninfer_lane_weight", "ninfer_queue_weight",
                    "ninfer_pressure_weight"}, "metrics")
    metrics = MetricsConfig(
        poll_interval=_num(m, "poll_interval", "metrics", 1.0, 0.1, 60.0),
        stale_threshold=_num(m, "stale_threshold", "metrics", 3.0, 0.1, 600.0),
        ninfer_lane_weight=_num(m, "ninfer_lane_weight", "metrics", 0.75, 0.0, 1.0),
        ninfer_queue_weight=_num(m, "ninfer_queue_weight", "metrics", 0.15, 0.0, 1.0),
        ninfer_pressure_weight=_num(m, "ninfer_pressure_weight", "metrics", 0.10, 0.0, 1.0),
    )
    g = _obj(root.get("gateway", {}), "gateway")
    _check_keys(g, {"request_timeout_s", "first_byte_timeout_s", "max_body_bytes", "max_concurrent_per_key",
                    "reserve_output_tokens"}, "gateway")
    limits = Limits(
        request_timeout_s=_num(g, "request_timeout_s", "gateway", 600.0, 1.0, 86400.0),
        first_byte_timeout_s=_num(g, "first_byte_timeout_s", "gateway", 5.0, 0.1, 600.0),
        max_body_bytes=int(_num(g, "max_body_bytes", "gateway", 4 * 1024 * 1024, 1024, 64 * 1024 * 1024)),
        max_concurrent_per_key=int(_num(g, "max_concurrent_per_key", "gateway", 64, 1, 100_000)),
        reserve_output_tokens=int(_num(g, "reserve_output_tokens", "gateway", 1024, 1, 10_000_000)),
    )
    return GatewayFileConfig(
        pools=pools,
        electricity_rate_usd_per_kwh=_num(root, "electricity_rate_usd_per_kwh", "", 0.125, 0.0, 100.0),
        price_book=prices, metrics=metrics, limits=limits,
    )


def load(path: Path) -> GatewayFileConfig:
    """Read and validate the file; every problem is a ConfigError naming the key."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError("config", f"{path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
                          ) from None
    return parse(data)


def to_dict(config: GatewayFileConfig) -> dict[str, Any]:
    """The file form of a config (``parse(to_dict(c)) == c``): what the Config page saves."""
    pools: dict[str, Any] = {}
    for name, p in config.pools.items():
        members = []
        for m in p.members:
            entry: dict[str, Any] = {"model_id": m.model_id, "backend": m.backend, "capacity_weight": m.capacity_weight}
            if m.max_context is not None:
                entry["max_context"] = m.max_context
            default_id = member_id_for(m.backend) if m.backend != "bus:*" else f"bus-{m.model_id}"
            if m.member_id != default_id:
                entry["id"] = m.member_id
            members.append(entry)
        pools[name] = {"members": members, "cache_affinity": p.cache_affinity,
                       "overflow_threshold": p.overflow_threshold, "sticky_bias": p.sticky_bias,
                       "capacity_bias": p.capacity_bias, "max_pool_share": p.max_pool_share,
                       "aliases": list(p.aliases)}
    return {
        "model_pools": pools,
        "electricity_rate_usd_per_kwh": config.electricity_rate_usd_per_kwh,
        "price_book": {model: {"prompt_usd_per_m": pr.prompt_usd_per_m, "cached_usd_per_m": pr.cached_usd_per_m,
                               "output_usd_per_m": pr.output_usd_per_m} for model, pr in config.price_book.items()},
        "metrics": dict(vars(config.metrics)),
        "gateway": dict(vars(config.limits)),
    }


@dataclass(frozen=True)
class ConfigChange:
    """A gateway's saved pools file, as broadcast on ``llm.v1.config.changed`` (Config page saves)."""

    gateway_id: str
    raw: dict[str, Any]  # the file form, as saved
    config: GatewayFileConfig  # the same, validated


def change_message(gateway_id: str, raw: dict[str, Any]) -> bytes:
    return encode_json(ConfigChanged(gateway_id=gateway_id, config=raw))


def read_change_message(data: bytes) -> ConfigChange:
    """Decode and validate a config-changed message; anything wrong is a ConfigError naming why."""
    try:
        message = decode_json(data, ConfigChanged)
    except ProtoDecodeError as exc:
        if exc.is_malformed:
            raise ConfigError("config-changed", f"not JSON: {exc.reason}") from None
        raise ConfigError("config-changed", 'expected {"gateway_id": str, "config": {...}}') from None
    return ConfigChange(message.gateway_id, message.config, parse(message.config))
