"""Which members serve a model name: configured pools first, then bus engines no pool names (discovery).

Pure: works on the parsed config and the fleet's member ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from proto.pools import GatewayFileConfig, MemberConfig, PoolConfig
from services.gateway.fleet import Fleet


@dataclass(frozen=True)
class MemberRef:
    member_id: str
    model_id: str  # what the member itself calls the model
    kind: str  # "bus" | "http"
    config: MemberConfig | None  # None for discovered bus workers
    capacity_weight: float = 1.0
    max_context: int | None = None

    @property
    def backend(self) -> str:
        return self.config.backend if self.config is not None else f"bus:{self.member_id}"


@dataclass(frozen=True)
class ResolvedPool:
    pool: PoolConfig
    members: tuple[MemberRef, ...]
    discovered: bool


def _configured_members(pool: PoolConfig, fleet: Fleet) -> list[MemberRef]:
    refs = []
    for m in pool.members:
        if m.is_http:
            refs.append(MemberRef(m.member_id, m.model_id, "http", m, m.capacity_weight, m.max_context))
        elif m.bus_worker == "*":
            refs += [MemberRef(w, m.model_id, "bus", m, m.capacity_weight, m.max_context)
                     for w in fleet.bus_workers(m.model_id)]
        else:
            refs.append(MemberRef(m.member_id, m.model_id, "bus", m, m.capacity_weight, m.max_context))
    return refs


def pooled_bus_workers(config: GatewayFileConfig, fleet: Fleet) -> set[str]:
    named: set[str] = set()
    for pool in config.pools.values():
        named |= {r.member_id for r in _configured_members(pool, fleet) if r.kind == "bus"}
    return named


def resolve(model: str, config: GatewayFileConfig, fleet: Fleet) -> ResolvedPool | None:
    pool = config.pool_for(model)
    if pool is not None:
        return ResolvedPool(pool, tuple(_configured_members(pool, fleet)), discovered=False)
    named = pooled_bus_workers(config, fleet)
    workers = [w for w in fleet.bus_workers(model) if w not in named]
    if not workers:
        return None
    return ResolvedPool(PoolConfig(name=model, members=()),
                        tuple(MemberRef(w, model, "bus", None) for w in workers), discovered=True)


def model_names(config: GatewayFileConfig, fleet: Fleet) -> list[str]:
    """Every name a client can use: pools, their aliases, and discovered models."""
    names = set(config.pools)
    for pool in config.pools.values():
        names |= set(pool.aliases)
    named = pooled_bus_workers(config, fleet)
    for wid in fleet.bus_workers():
        hb = fleet.members[wid].heartbeat
        if wid not in named and hb is not None and hb.model_id:
            names.add(hb.model_id)
    return sorted(names)
