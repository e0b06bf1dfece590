"""The pools file shared by the gateway (routing) and telemetry (which HTTP members to scrape), as msgspec Structs.

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

An HTTP member that wants a key (vLLM or our engine with ``--api-key``, a hosted API) gets
``"api_key_env": "VAR"`` — the name of an environment variable read when the file is parsed (missing or
empty: a ConfigError naming the key) — or, discouraged, a literal ``"api_key"`` (a warning at every
:func:`load`). Either is sent as ``Authorization: Bearer`` on every request to that member, by the gateway
and by telemetry. The key is a secret: :class:`MemberConfig`'s repr masks it, :func:`to_dict` writes only
what the file held (the env var's name, or the literal the operator wrote), and the pages never show it.

Validation is strict: unknown keys, wrong types, bad URLs and out-of-range weights are errors that name
the key path (``model_pools.qwen.members[1].backend: …``). A broken file at reload keeps the old config.

Why msgspec: it is the library the bus contract already keeps (``proto/``), so the file's schema is the
Structs below — each knob's type, bounds (``Meta``) and default written once, in its field — instead of
~150 lines of hand-written checks that repeated every default. ``msgspec.convert`` reports the path of
the first bad value (``$.members[1].backend``), which :func:`parse` turns into the key path above; and it
is fast: a file of 17 pools and 130 members parses in 1.3 ms (1.8 ms with the old hand-written checks; best
of 5 x 2,000 parses, one core of the dev box), most of it the per-member URL work msgspec cannot do.
The file is JSON read by :func:`json.loads` (whose errors give line and column), then converted.

This module imports no service: :class:`ConfigError`, the one configuration error of the project, is
defined here (the pools file is the configuration that crosses the bus) and ``services.common.runtime``
uses it from here.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, TypeVar
from urllib.parse import urlsplit

import msgspec
import msgspec.inspect
from msgspec import Meta

from proto.admin import ConfigChanged
from proto.codec import ProtoDecodeError, decode_json, encode_json

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_ID_SAFE = re.compile(r"[^A-Za-z0-9_-]+")
_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}\Z"  # \Z, not $: "$" also matches before a trailing newline
# http(s) URLs are checked further by _checked_member (host, port, no query); bus ids fully here
_ENV_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z"
_BACKEND_PATTERN = r"^(https?://|bus:(\*|[A-Za-z0-9_-]{1,128})\Z)"

# what a failed regex means, in words, per key (msgspec's message shows the pattern)
_PATTERN_REASONS = {
    "backend": "must be an http(s):// URL, bus:<worker_id> (of [A-Za-z0-9_-]) or bus:*",
    "id": "must be 1-128 of [A-Za-z0-9_-]",
    "api_key_env": "must be an environment variable name ([A-Za-z_][A-Za-z0-9_]*)",
}

NonEmptyStr = Annotated[str, Meta(min_length=1)]
Fraction = Annotated[float, Meta(ge=0.0, le=1.0)]


class ConfigError(ValueError):
    """A bad or missing configuration value; the message names the key."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"config {key}: {reason}")
        self.key = key
        self.reason = reason


class MemberConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # "id" in the file; when absent, parse() sets default_member_id(backend, model_id)
    member_id: Annotated[str, Meta(pattern=_ID_PATTERN)] = msgspec.field(default="", name="id")
    model_id: NonEmptyStr
    backend: Annotated[str, Meta(pattern=_BACKEND_PATTERN)]  # http(s) URL, "bus:<worker_id>" or "bus:*"
    # 0 (the Go gateway's "unset"): the member's lanes from its heartbeat are its weight
    capacity_weight: Annotated[float, Meta(ge=0.0)] = 1.0
    max_context: Annotated[int, Meta(ge=1)] | None = None  # 0 in the file (the engine's own value) reads as None
    # the engine's max_num_seqs where it does not export it (vLLM); else metrics.backend_max_seqs, then
    # metrics.default_max_seqs (docs/telemetry.md)
    max_seqs: Annotated[int, Meta(ge=1, le=1_000_000)] | None = None
    # the env var holding the member's key; parse() reads it into api_key (to_dict writes only the name back)
    api_key_env: Annotated[str, Meta(pattern=_ENV_PATTERN)] | None = None
    api_key: NonEmptyStr | None = None  # sent as "Authorization: Bearer"; a literal in the file is discouraged

    def __repr__(self) -> str:  # the key never reaches a log line through a repr
        shown = {f: getattr(self, f) for f in self.__struct_fields__ if f != "api_key"}
        fields = ", ".join(f"{k}={v!r}" for k, v in shown.items())
        return f"MemberConfig({fields}, api_key={'<set>' if self.api_key else None})"

    @property
    def is_http(self) -> bool:
        return self.backend.startswith(("http://", "https://"))

    @property
    def bus_worker(self) -> str | None:
        """The worker id for ``bus:<id>``, ``"*"`` for ``bus:*``, None for HTTP members."""
        return self.backend.removeprefix("bus:") if self.backend.startswith("bus:") else None


class PoolConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # the key in model_pools, not a key of the pool's object (parse() rejects "name" there)
    name: str = ""
    members: Annotated[tuple[MemberConfig, ...], Meta(min_length=1)]
    cache_affinity: bool = True
    overflow_threshold: Fraction = 0.95
    sticky_bias: Fraction = 0.2
    capacity_bias: Fraction = 0.1
    # soft fairness cap (0 = off): a member past this share of the pool's routes today gets no new conversation
    max_pool_share: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    aliases: tuple[NonEmptyStr, ...] = ()
    # energy tie-break (0 = off; docs/routing.md §3): among members within this cost of the cheapest, the one with
    # the lowest measured J/output-token
    energy_margin: Fraction = 0.0


class Prices(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    prompt_usd_per_m: Annotated[float, Meta(ge=0.0)] = 0.0
    cached_usd_per_m: Annotated[float, Meta(ge=0.0)] = 0.0
    output_usd_per_m: Annotated[float, Meta(ge=0.0)] = 0.0


class MetricsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    poll_interval: Annotated[float, Meta(ge=0.1, le=60.0)] = 1.0
    stale_threshold: Annotated[float, Meta(ge=0.1, le=600.0)] = 3.0
    ninfer_lane_weight: Fraction = 0.75
    ninfer_queue_weight: Fraction = 0.15
    ninfer_pressure_weight: Fraction = 0.10
    # vLLM does not export max_num_seqs: lanes for members that do not say (the Go gateway's default 3; 0 = 3)
    default_max_seqs: Annotated[int, Meta(ge=0, le=1_000_000)] = 3
    backend_max_seqs: dict[str, Annotated[int, Meta(ge=0, le=1_000_000)]] = msgspec.field(default_factory=dict)

    def max_seqs_for(self, member: MemberConfig) -> int | None:
        """The operator's lane count for ``member``: its own ``max_seqs``, else ``backend_max_seqs`` by backend
        URL (trailing ``/`` ignored; 0 means "not set", as upstream); None when neither says."""
        if member.max_seqs:
            return member.max_seqs
        for backend, n in self.backend_max_seqs.items():
            if n > 0 and backend.rstrip("/") == member.backend.rstrip("/"):
                return n
        return None

    @property
    def default_lanes(self) -> int:
        return self.default_max_seqs or 3


class Limits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The file's ``gateway`` section."""

    request_timeout_s: Annotated[float, Meta(ge=1.0, le=86400.0)] = 600.0
    first_byte_timeout_s: Annotated[float, Meta(ge=0.1, le=600.0)] = 5.0
    max_body_bytes: Annotated[int, Meta(ge=1024, le=64 * 1024 * 1024)] = 4 * 1024 * 1024
    max_concurrent_per_key: Annotated[int, Meta(ge=1, le=100_000)] = 64
    # what a limit reservation counts for a request without max_tokens (docs/admin.md, "Limits")
    reserve_output_tokens: Annotated[int, Meta(ge=1, le=10_000_000)] = 1024
    # the Go gateway's keys with a meaning here: the listen port when neither --port nor $LLMGW_PORT says;
    # callers from the file's local_networks need no key when trust_local_networks is on; GET /v1/models
    # needs a key when models_require_auth is on (it is public otherwise, as upstream)
    port: Annotated[int, Meta(ge=0, le=65535)] | None = None
    trust_local_networks: bool = False
    models_require_auth: bool = False


class GatewayFileConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pools: dict[str, PoolConfig] = msgspec.field(default_factory=dict, name="model_pools")
    electricity_rate_usd_per_kwh: Annotated[float, Meta(ge=0.0, le=100.0)] = 0.125
    price_book: dict[str, Prices] = msgspec.field(default_factory=dict)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    limits: Limits = msgspec.field(default_factory=Limits, name="gateway")
    local_networks: tuple[NonEmptyStr, ...] = ()  # trusted when gateway.trust_local_networks is on

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


def member_id_for(backend: str) -> str:
    """A stable, subject-safe id for a member: the worker id for bus members, host-port for URLs."""
    if backend.startswith("bus:"):
        return backend.removeprefix("bus:")
    parts = urlsplit(backend)
    return _ID_SAFE.sub("-", f"http-{parts.hostname}-{parts.port or (443 if parts.scheme == 'https' else 80)}"
                             f"{parts.path.rstrip('/')}").strip("-")


def default_member_id(backend: str, model_id: str) -> str:
    """A member's id when the file gives none (``bus:*`` stands for every worker of the model)."""
    return member_id_for(backend) if backend != "bus:*" else f"bus-{model_id}"


def _value_at(data: Any, path: list[str | int]) -> tuple[bool, Any]:
    """The raw value at ``path`` in ``data``, if it is there (to show what was wrong)."""
    for step in path:
        if isinstance(step, int) and isinstance(data, list) and 0 <= step < len(data):
            data = data[step]
        elif isinstance(step, str) and isinstance(data, dict) and step in data:
            data = data[step]
        else:
            return False, None
    return True, data


_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_AT = re.compile(r"(.*) - at `(\$[A-Za-z0-9_.\[\]]*)`", re.DOTALL)  # msgspec's paths name fields and indexes only
_FIELD = re.compile(r"Object (contains unknown|missing required) field `(.*)`", re.DOTALL)


def _steps(at: str) -> list[str | int]:
    return [int(i) if i else name for name, i in _STEP.findall(at)]


def _type_at(kind: type, steps: list[str | int]) -> Any:
    """msgspec's type info for the value at ``steps`` below a ``kind`` (None where no type says)."""
    info: Any = msgspec.inspect.type_info(kind)
    for step in steps:
        if isinstance(info, msgspec.inspect.StructType) and isinstance(step, str):
            info = next((f.type for f in info.fields if f.encode_name == step), None)
        elif isinstance(info, msgspec.inspect.VarTupleType) and isinstance(step, int):
            info = info.item_type
        else:
            return None
    return info


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _reason(info: Any, value: Any, field: str | int | None, default: str) -> str:
    """What is wrong with ``value``, in the words the Config page shows (``must be in [0.0, 1.0], got 1.5``)."""
    if isinstance(info, msgspec.inspect.FloatType | msgspec.inspect.IntType):
        lo, hi = (info.gt if info.gt is not None else info.ge), info.le
        bounds = f"{'(' if info.gt is not None else '['}{lo}, {hi if hi is not None else '∞'}]"
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"must be a number, got {_shown(value)}"
        if isinstance(info, msgspec.inspect.IntType) and not isinstance(value, int):
            return f"must be a whole number in {bounds}, got {_shown(value)}"
        return f"must be in {bounds}, got {_shown(value)}"
    if isinstance(info, msgspec.inspect.UnionType) and any(isinstance(t, msgspec.inspect.IntType) for t in info.types):
        return f"must be a positive integer, got {_shown(value)}"  # max_context, or null
    if isinstance(info, msgspec.inspect.BoolType):
        return f"must be true or false, got {_shown(value)}"
    if isinstance(info, msgspec.inspect.StrType) and isinstance(value, str):
        if info.pattern is not None and field in _PATTERN_REASONS:
            return f"{_PATTERN_REASONS[str(field)]}, got {_shown(value)}"
        if info.min_length and not value:
            return "must be a non-empty string"
    if isinstance(value, dict | list):
        return default
    return f"{default}: {_shown(value)}"


def _config_error(exc: msgspec.ValidationError, data: Any, kind: type, prefix: str) -> ConfigError:
    """msgspec's ``Expected … - at `$.members[1].backend``` as a ConfigError naming ``prefix.members[1].backend``."""
    text = str(exc)
    at_path = _AT.fullmatch(text)
    reason, at = (at_path[1], at_path[2].removeprefix("$")) if at_path else (text, "")
    unknown = _FIELD.fullmatch(text)  # with no path: at the top
    if unknown and unknown[1] == "contains unknown" and unknown[2] in (data if isinstance(data, dict) else {}):
        reason, at = text, ""  # the unknown key's own name held " - at `$…`"
    steps = _steps(at)
    field = _FIELD.fullmatch(reason)
    if field:
        key = f"{prefix}{at}.{field[2]}"
        if field[1] == "missing required":
            return ConfigError(key.removeprefix("."), "required")
        info = _type_at(kind, steps)
        allowed = [f.encode_name for f in info.fields if (info.cls, f.name) != (PoolConfig, "name")] \
            if isinstance(info, msgspec.inspect.StructType) else []
        return ConfigError(key.removeprefix("."), f"unknown key (allowed: {', '.join(sorted(allowed))})")
    found, value = _value_at(data, steps)
    if found:
        reason = _reason(_type_at(kind, steps), value, steps[-1] if steps else None, reason)
    return ConfigError(f"{prefix}{at}".removeprefix(".") or "config", reason)


def _convert(data: Any, kind: type[_T], prefix: str) -> _T:
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as exc:
        raise _config_error(exc, data, kind, prefix) from None


def _entries(root: dict[str, Any], key: str) -> dict[str, Any]:
    """A map section (``model_pools``, ``price_book``): converted entry by entry, so errors name the entry."""
    value = root.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(key, f"must be an object, got {type(value).__name__}")
    return value


def _checked_member(m: MemberConfig, path: str) -> MemberConfig:
    """What the Struct's constraints cannot say: a usable base URL, and the id when the file gives none."""
    if m.is_http:
        try:
            parts = urlsplit(m.backend)
            _ = parts.port  # raises ValueError on a bad port
        except ValueError:
            raise ConfigError(f"{path}.backend", f"bad port in {m.backend!r}") from None
        if not parts.hostname or parts.query or parts.fragment:
            raise ConfigError(f"{path}.backend", f"not a usable base URL: {m.backend!r}")
        if parts.username is not None and (m.api_key or m.api_key_env):
            raise ConfigError(f"{path}.api_key", "give a key or user:password in the backend URL, not both")
    elif m.api_key or m.api_key_env:
        raise ConfigError(f"{path}.{'api_key_env' if m.api_key_env else 'api_key'}",
                          "only http(s) members take a key (bus members are ours)")
    if m.api_key_env is not None:
        if m.api_key is not None:
            raise ConfigError(f"{path}.api_key", "give api_key or api_key_env, not both")
        key = os.environ.get(m.api_key_env, "")
        if not key:
            raise ConfigError(f"{path}.api_key_env", f"environment variable {m.api_key_env} is not set or empty")
        m = msgspec.structs.replace(m, api_key=key)
    member_id = m.member_id or default_member_id(m.backend, m.model_id)
    if not re.fullmatch(_ID_PATTERN, member_id):
        raise ConfigError(f"{path}.id", f"{_PATTERN_REASONS['id']}, got {member_id!r}")
    return msgspec.structs.replace(m, member_id=member_id, backend=m.backend.rstrip("/"))


def _pool(name: str, raw: Any) -> PoolConfig:
    path = f"model_pools.{name}"
    if isinstance(raw, dict) and "name" in raw:  # the key names the pool
        raise ConfigError(f"{path}.name", "unknown key (the pool's key in model_pools is its name)")
    pool = _convert(raw, PoolConfig, path)
    members = tuple(_checked_member(m, f"{path}.members[{i}]") for i, m in enumerate(pool.members))
    ids = [m.member_id for m in members]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"{path}.members", f"member {dupes[0]!r} is listed twice")
    return msgspec.structs.replace(pool, name=name, members=members)


# The Go llm-gateway's keys that mean nothing here, and why (docs/deploy.md, "Coming from the Go gateway"):
# a file written for it loads with one warning per key instead of a refusal.
_UPSTREAM_IGNORED = {
    "discovery": "list HTTP engines as pool members; engines on the bus are discovered without configuration",
    "hosts": "energy is each engine's own measured counter; host overhead watts and capex are not modelled",
    "cache": "the model catalogue is built from live heartbeats, there is nothing to cache",
    "image_prompting": "images are not served",
    "alerts": "alerting is Prometheus' job here (deploy/observability)",
    "rag": "document search is not part of this gateway",
    "model_capabilities": "capabilities are not overridden here",
    "overflow_pairs": "overflow happens within a pool (overflow_threshold)",
    "public_models": "every pool and discovered model is listed",
}
_UPSTREAM_IGNORED_GATEWAY = {
    "api_keys_file": "keys live in the gateway's identity store (llmgw admin keys create)",
    "internal_api_key_file": "services authenticate on the bus, not with a shared key",
    "users_file": "users live in the gateway's identity store (llmgw admin users)",
    "usage_file": "usage goes to the accounting ledger (DuckDB)",
    "public_base_url": "pages use the URL the browser came in on",
}
_UPSTREAM_IGNORED_POOL = {"large_prompt_tokens": "members that cannot hold a prompt are skipped by max_context"}
_UPSTREAM_IGNORED_MEMBER = {"large_context": "give the member's max_context instead"}
_PRICE_KEYS = frozenset({"prompt_usd_per_m", "cached_usd_per_m", "output_usd_per_m"})


def _without(section: dict[str, Any], ignored: dict[str, str], path: str, warnings: list[str]) -> dict[str, Any]:
    for key in sorted(set(section) & set(ignored)):
        warnings.append(f"config {path}{key}: ignored ({ignored[key]})")
    return {k: v for k, v in section.items() if k not in ignored}


def _upstream(data: dict[str, Any], warnings: list[str]) -> dict[str, Any]:
    """A Go-gateway file in this gateway's form: its keys with a meaning here keep their upstream semantics
    (flat ``price_book`` = every model's price, ``max_context: 0`` = the engine's value, top-level
    ``backend_max_seqs``), the rest are dropped with a warning each. Files in our own form pass unchanged."""
    data = _without(data, _UPSTREAM_IGNORED, "", warnings)
    book = data.get("price_book")
    if isinstance(book, dict) and book and set(book) <= _PRICE_KEYS and not any(isinstance(v, dict)
                                                                                for v in book.values()):
        data["price_book"] = {"*": book}  # upstream: one price book for every model
    if isinstance(data.get("gateway"), dict):
        data["gateway"] = _without(data["gateway"], _UPSTREAM_IGNORED_GATEWAY, "gateway.", warnings)
    if "backend_max_seqs" in data:  # SPEC §10 lists it at the top as well as under metrics
        top = data.pop("backend_max_seqs")
        metrics = data.get("metrics", {})
        if isinstance(top, dict) and isinstance(metrics, dict):
            inner = metrics.get("backend_max_seqs", {})
            data["metrics"] = {**metrics, "backend_max_seqs": {**top, **inner} if isinstance(inner, dict) else inner}
        elif not isinstance(top, dict):
            raise ConfigError("backend_max_seqs", f"must be an object, got {type(top).__name__}")
    pools = data.get("model_pools")
    if isinstance(pools, dict):
        fixed: dict[str, Any] = {}
        for name, pool in pools.items():
            if isinstance(pool, dict):
                pool = _without(pool, _UPSTREAM_IGNORED_POOL, f"model_pools.{name}.", warnings)
                if isinstance(pool.get("members"), list):
                    members = []
                    for i, m in enumerate(pool["members"]):
                        if isinstance(m, dict):
                            m = _without(m, _UPSTREAM_IGNORED_MEMBER, f"model_pools.{name}.members[{i}].", warnings)
                            if m.get("max_context") == 0 and not isinstance(m.get("max_context"), bool):
                                m = {k: v for k, v in m.items() if k != "max_context"}  # 0: the engine's value
                        members.append(m)
                    pool = {**pool, "members": members}
            fixed[name] = pool
        data["model_pools"] = fixed
    return data


def _refuse_non_finite(data: Any, path: str = "") -> None:
    """``json.loads`` reads ``NaN`` and ``Infinity``; no knob means either (an unbounded one, a price or a
    capacity weight, would take ``Infinity``): refused, naming the key."""
    if isinstance(data, float) and not math.isfinite(data):
        raise ConfigError(path or "config", f"must be a finite number, got {data!r}")
    if isinstance(data, dict):
        for key, value in data.items():
            _refuse_non_finite(value, f"{path}.{key}" if path else str(key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            _refuse_non_finite(value, f"{path}[{i}]")


def parse(data: Any, warnings: list[str] | None = None) -> GatewayFileConfig:
    """Validate the parsed file; every problem is a ConfigError naming the key. Keys of the Go gateway's file
    that mean nothing here are dropped and described in ``warnings`` (one line each)."""
    if not isinstance(data, dict):
        raise ConfigError("config", f"must be an object, got {type(data).__name__}")
    _refuse_non_finite(data)
    data = _upstream(data, warnings if warnings is not None else [])
    pools = {name: _pool(name, raw) for name, raw in _entries(data, "model_pools").items()}
    names: dict[str, str] = {}
    for pool in pools.values():
        for alias in (pool.name, *pool.aliases):
            if alias in names and names[alias] != pool.name:
                raise ConfigError(f"model_pools.{pool.name}.aliases", f"{alias!r} already names pool {names[alias]!r}")
            names[alias] = pool.name
    networks = data.get("local_networks")
    for i, net in enumerate(networks if isinstance(networks, list | tuple) else ()):
        try:
            ipaddress.ip_network(net.strip() if isinstance(net, str) else net, strict=False)
        except (ValueError, TypeError):
            raise ConfigError(f"local_networks[{i}]", f"{net!r} is not a network (use CIDR, e.g. 192.168.1.0/24)"
                              ) from None
    prices = {model: _convert(raw, Prices, f"price_book.{model}")
              for model, raw in _entries(data, "price_book").items()}
    rest = {k: v for k, v in data.items() if k not in ("model_pools", "price_book")}
    return msgspec.structs.replace(_convert(rest, GatewayFileConfig, ""), pools=pools, price_book=prices)


def load(path: Path) -> GatewayFileConfig:
    """Read and validate the file; every problem is a ConfigError naming the key."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("config", f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError("config", f"{path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
                          ) from None
    except (ValueError, RecursionError) as exc:  # an integer of over 4,300 digits; nesting past the stack
        raise ConfigError("config", f"{path} is not usable JSON: {exc}") from None
    warnings: list[str] = []
    config = parse(data, warnings)
    for line in warnings:
        log.warning("%s", line)
    for pool in config.pools.values():
        for i, m in enumerate(pool.members):
            if m.api_key is not None and m.api_key_env is None:
                log.warning("config model_pools.%s.members[%d].api_key: the member's key is stored in %s; "
                            "prefer api_key_env (the name of an environment variable)", pool.name, i, path)
    return config


def to_dict(config: GatewayFileConfig) -> dict[str, Any]:
    """The file form of a config (``parse(to_dict(c)) == c``): what the Config page saves."""
    pools: dict[str, Any] = {}
    for name, p in config.pools.items():
        members = []
        for m in p.members:
            entry: dict[str, Any] = {"model_id": m.model_id, "backend": m.backend, "capacity_weight": m.capacity_weight}
            if m.max_context is not None:
                entry["max_context"] = m.max_context
            if m.max_seqs is not None:
                entry["max_seqs"] = m.max_seqs
            if m.member_id != default_member_id(m.backend, m.model_id):
                entry["id"] = m.member_id
            if m.api_key_env is not None:
                entry["api_key_env"] = m.api_key_env  # the name only: the key stays in the environment
            elif m.api_key is not None:
                entry["api_key"] = m.api_key  # the operator's literal, kept (pages never render it)
            members.append(entry)
        pools[name] = {"members": members, "cache_affinity": p.cache_affinity,
                       "overflow_threshold": p.overflow_threshold, "sticky_bias": p.sticky_bias,
                       "capacity_bias": p.capacity_bias, "max_pool_share": p.max_pool_share,
                       "aliases": list(p.aliases)}
        if p.energy_margin:
            pools[name]["energy_margin"] = p.energy_margin
    return {
        "model_pools": pools,
        "electricity_rate_usd_per_kwh": config.electricity_rate_usd_per_kwh,
        "price_book": {model: msgspec.structs.asdict(pr) for model, pr in config.price_book.items()},
        "metrics": msgspec.structs.asdict(config.metrics),
        # the Go gateway's keys only where set, so a file of ours keeps its shape
        "gateway": {k: v for k, v in msgspec.structs.asdict(config.limits).items()
                    if k not in ("port", "trust_local_networks", "models_require_auth") or v},
        **({"local_networks": list(config.local_networks)} if config.local_networks else {}),
    }


class ConfigChange(msgspec.Struct, frozen=True, kw_only=True):
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
    return ConfigChange(gateway_id=message.gateway_id, raw=message.config, config=parse(message.config))
