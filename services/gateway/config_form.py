"""The Config page's form ↔ the pools file. Pure: no I/O.

Field names: ``pool.I.FIELD``, ``pool.I.member.J.FIELD`` (``J`` = ``new`` for the empty row),
``newpool.FIELD``, ``price.K.FIELD``, ``electricity_rate_usd_per_kwh``. :func:`from_form` builds the file
form of the config and, for every config key path it produced, the form field it came from, so a
``ConfigError`` from ``proto.pools.parse`` (which names a key path) lands next to the right input.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

_POOL_NUMBERS = ("overflow_threshold", "sticky_bias", "capacity_bias")
_PRICE_FIELDS = ("prompt_usd_per_m", "cached_usd_per_m", "output_usd_per_m")


@dataclass
class FormResult:
    raw: dict[str, Any]
    errors: dict[str, str] = field(default_factory=dict)
    fields: dict[str, str] = field(default_factory=dict)  # config key path → form field name

    def field_for(self, key_path: str) -> str:
        """The form field for a ConfigError's key path (the longest known prefix; "_" for the page)."""
        key_path = key_path.lstrip(".")
        best = ""
        for path in self.fields:
            if (key_path == path or key_path.startswith(path + ".") or key_path.startswith(path + "[")) \
                    and len(path) > len(best):
                best = path
        return self.fields[best] if best else "_"


def view_model(raw: dict[str, Any]) -> dict[str, Any]:
    """What config.html renders, from the file form of a config."""
    pools = []
    for name, p in raw.get("model_pools", {}).items():
        pools.append({
            "name": name, **{k: p.get(k) for k in _POOL_NUMBERS}, "cache_affinity": p.get("cache_affinity", True),
            "aliases": ", ".join(p.get("aliases", [])),
            "members": [{"backend": m.get("backend"), "model_id": m.get("model_id"), "id": m.get("id"),
                         "capacity_weight": m.get("capacity_weight"), "max_context": m.get("max_context")}
                        for m in p.get("members", [])],
        })
    prices = [{"model": model, **{k: v.get(k) for k in _PRICE_FIELDS}}
              for model, v in raw.get("price_book", {}).items()]
    prices.append({"model": "", **{k: None for k in _PRICE_FIELDS}})
    return {"pools": pools, "prices": prices, "rate": raw.get("electricity_rate_usd_per_kwh")}


def _number(form: dict[str, str], name: str, result: FormResult, integer: bool = False) -> float | int | None:
    text = form.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text) if integer else float(text)
    except ValueError:
        result.errors[name] = "must be a whole number" if integer else "must be a number"
        return None


def _member(form: dict[str, str], prefix: str, path: str, result: FormResult) -> dict[str, Any] | None:
    backend = form.get(f"{prefix}.backend", "").strip()
    model_id = form.get(f"{prefix}.model_id", "").strip()
    if not backend and not model_id:
        return None
    member: dict[str, Any] = {"model_id": model_id, "backend": backend}
    weight = _number(form, f"{prefix}.capacity_weight", result)
    if weight is not None:  # blank: the pools file's default (proto/pools.py)
        member["capacity_weight"] = weight
    max_context = _number(form, f"{prefix}.max_context", result, integer=True)
    if max_context is not None:
        member["max_context"] = max_context
    if form.get(f"{prefix}.id", "").strip():
        member["id"] = form[f"{prefix}.id"].strip()
    for key in ("model_id", "backend", "capacity_weight", "max_context", "id"):
        result.fields[f"{path}.{key}"] = f"{prefix}.{key}"
    return member


# A member's keys the page neither shows nor edits: kept for a member whose backend was in the pool. The
# credentials so that the secret never travels through the browser; max_seqs (a vLLM member's lanes) so that a
# save does not drop it.
_UNSHOWN_MEMBER_KEYS = ("api_key_env", "api_key", "max_seqs")


def _keep_unshown(members: list[dict[str, Any]], before: list[dict[str, Any]]) -> None:
    for member in members:
        old = next((m for m in before if m.get("backend") == member["backend"]), None)
        for key in _UNSHOWN_MEMBER_KEYS:
            if old is not None and key in old:
                member[key] = old[key]


def from_form(form: dict[str, str], current: dict[str, Any]) -> FormResult:
    """The posted form applied to ``current`` (sections the page does not show are kept as they are)."""
    raw = copy.deepcopy(current)
    result = FormResult(raw)
    pools: dict[str, Any] = {}
    i = 0
    while f"pool.{i}.name" in form:
        name = form[f"pool.{i}.name"]
        prefix, path = f"pool.{i}", f"model_pools.{name}"
        if form.get(f"{prefix}.remove"):
            i += 1
            continue
        pool = dict(current.get("model_pools", {}).get(name, {}))
        for key in _POOL_NUMBERS:
            value = _number(form, f"{prefix}.{key}", result)
            if value is not None:
                pool[key] = value
            result.fields[f"{path}.{key}"] = f"{prefix}.{key}"
        pool["cache_affinity"] = bool(form.get(f"{prefix}.cache_affinity"))
        pool["aliases"] = [a.strip() for a in form.get(f"{prefix}.aliases", "").split(",") if a.strip()]
        result.fields[f"{path}.aliases"] = f"{prefix}.aliases"
        result.fields[f"{path}.members"] = f"{prefix}.member.new.backend"
        members: list[dict[str, Any]] = []
        j = 0
        while f"{prefix}.member.{j}.backend" in form:
            if not form.get(f"{prefix}.member.{j}.remove"):
                member = _member(form, f"{prefix}.member.{j}", f"{path}.members[{len(members)}]", result)
                if member is not None:
                    members.append(member)
            j += 1
        new = _member(form, f"{prefix}.member.new", f"{path}.members[{len(members)}]", result)
        if new is not None:
            members.append(new)
        _keep_unshown(members, pool.get("members", []))
        pool["members"] = members
        pools[name] = pool
        i += 1
    new_name = form.get("newpool.name", "").strip()
    if new_name:
        if new_name in pools:
            result.errors["newpool.name"] = f"a pool named {new_name!r} exists already"
        else:
            path = f"model_pools.{new_name}"
            pools[new_name] = {"members": [{"model_id": form.get("newpool.model_id", "").strip() or new_name,
                                            "backend": form.get("newpool.backend", "").strip()}]}
            result.fields[path] = "newpool.name"
            result.fields[f"{path}.members[0].backend"] = "newpool.backend"
            result.fields[f"{path}.members[0].model_id"] = "newpool.model_id"
    raw["model_pools"] = pools

    prices: dict[str, Any] = {}
    k = 0
    while f"price.{k}.model" in form:
        model = form[f"price.{k}.model"].strip()
        if model:
            if model in prices:
                result.errors[f"price.{k}.model"] = f"{model!r} is listed twice"
            entry = {}
            for key in _PRICE_FIELDS:
                value = _number(form, f"price.{k}.{key}", result)
                if value is not None:  # blank: the pools file's default
                    entry[key] = value
                result.fields[f"price_book.{model}.{key}"] = f"price.{k}.{key}"
            prices[model] = entry
        k += 1
    raw["price_book"] = prices

    rate = _number(form, "electricity_rate_usd_per_kwh", result)
    if rate is not None:
        raw["electricity_rate_usd_per_kwh"] = rate
    result.fields["electricity_rate_usd_per_kwh"] = "electricity_rate_usd_per_kwh"
    return result
