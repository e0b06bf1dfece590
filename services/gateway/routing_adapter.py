"""The seam between the gateway's I/O shell and the pure router (routing.py, affinity.py).

Builds the router's member states from the fleet and the pool config, asks for a ranking, records
successful routes into the affinity and pin tables, and persists those tables across restarts
(``DATA_DIR/routing/*.json``, atomic writes). All times here are wall-clock seconds, so persisted
entries keep their age across a restart.
"""

from __future__ import annotations

import collections
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from proto import SlotHeartbeat
from proto.pools import GatewayFileConfig, MetricsConfig, PoolConfig
from services.common import openai_api
from services.common.runtime import atomic_write_text
from services.gateway import pools, routing
from services.gateway.affinity import AffinityTable, PinTable, prefix_hashes
from services.gateway.breaker import STATE_CODE
from services.gateway.fleet import Fleet
from services.gateway.load_score import stale_limit_s
from services.gateway.pools import MemberRef, ResolvedPool

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Decision:
    pick: routing.Pick
    request: routing.RouteRequest
    policy: routing.PoolPolicy
    pool: str = ""  # the pool's name (its route counts, routing §3)

    @property
    def reason(self) -> str:
        return self.pick.reason

    @property
    def ranked(self) -> tuple[str, ...]:
        return self.pick.ranked

    def affinity_chars(self, member_id: str) -> int:
        for c in self.pick.candidates:
            if c.member_id == member_id:
                return c.affinity_chars
        return 0

    def explain(self) -> dict[str, Any]:
        return {
            "member": self.pick.member_id, "reason": self.pick.reason, "ranked": list(self.pick.ranked),
            "pinned_member": self.pick.pinned_member, "pin_broken": self.pick.pin_broken,
            "energy_over": self.pick.energy_over,
            "candidates": [asdict(c) for c in self.pick.candidates],
        }


def policy_for(pool: PoolConfig) -> routing.PoolPolicy:
    return _policy(pool.overflow_threshold, pool.cache_affinity, pool.sticky_bias, pool.capacity_bias,
                   pool.max_pool_share, pool.energy_margin)


# Asked for on every request: built once per distinct setting (the policy and weights are frozen, so one object
# serves every request and every pool with those values, discovered pools included).
@lru_cache(maxsize=256)
def _policy(overflow_threshold: float, cache_affinity: bool, sticky_bias: float, capacity_bias: float,
            max_pool_share: float, energy_margin: float = 0.0) -> routing.PoolPolicy:
    return routing.PoolPolicy(overflow_threshold=overflow_threshold, cache_affinity=cache_affinity,
                              sticky_bias=sticky_bias, capacity_bias=capacity_bias, max_pool_share=max_pool_share,
                              energy_margin=energy_margin)


# Each route multiplies a pool's recent-route counts by this (then adds 1 to the member's): they weigh about the
# last 1 / (1 - ROUTE_DECAY) = 100 routes, what the weighted split (routing §3) compares with the weights.
ROUTE_DECAY = 0.99


@dataclass
class PoolRoutes:
    """One pool's route counts at this gateway: decayed (the weighted split) and today's (max_pool_share)."""

    recent: dict[str, float] = field(default_factory=dict)
    day: str = ""
    today: collections.Counter[str] = field(default_factory=collections.Counter)

    def record(self, member_id: str, now_s: float) -> None:
        for mid in self.recent:
            self.recent[mid] *= ROUTE_DECAY
        self.recent[member_id] = self.recent.get(member_id, 0.0) + 1.0
        day = time.strftime("%Y-%m-%d", time.gmtime(now_s))
        if day != self.day:
            self.day, self.today = day, collections.Counter()
        self.today[member_id] += 1

    def today_counts(self, now_s: float) -> collections.Counter[str]:
        """Today's (UTC) routes per member; empty once the day has turned. Asked once per decision."""
        return self.today if self.day == time.strftime("%Y-%m-%d", time.gmtime(now_s)) else collections.Counter()


def effective_weight(ref: MemberRef, hb: SlotHeartbeat | None) -> float:
    """The member's capacity weight; 0 in the pools file (the Go gateway's "unset") means its lanes."""
    if ref.capacity_weight > 0:
        return ref.capacity_weight
    return float(hb.lanes) if hb is not None and hb.lanes else 1.0


def weights_for(metrics: MetricsConfig, stale_after_s: float) -> routing.RoutingWeights:
    return _weights(metrics.ninfer_lane_weight, metrics.ninfer_queue_weight, metrics.ninfer_pressure_weight,
                    stale_after_s)


@lru_cache(maxsize=64)  # by value: MetricsConfig holds a dict (backend_max_seqs), so it is not hashable
def _weights(lane: float, queue: float, pressure: float, stale_after_s: float) -> routing.RoutingWeights:
    return routing.RoutingWeights(ninfer_lane_weight=lane, ninfer_queue_weight=queue, ninfer_pressure_weight=pressure,
                                  stale_after_s=stale_after_s)


def prompt_chars(parsed: openai_api.ParsedRequest) -> int:
    """The characters of a request's prompt (every message's content and tool calls, the tools' names,
    descriptions and schemas; or the completion prompt)."""
    g = parsed.generate
    if not g.messages:
        return len(g.prompt or "")
    calls = sum(len(c.name) + len(c.arguments) for m in g.messages for c in m.tool_calls)
    tools = sum(len(t.name) + len(t.description or "") + len(t.parameters) for t in g.tools)
    return sum(len(m.content) for m in g.messages) + calls + tools


def prompt_tokens_estimate(parsed: openai_api.ParsedRequest) -> int:
    """The gateway's guess at a prompt's length in tokens (characters / CHARS_PER_TOKEN), before any
    engine has tokenized it: for routing, and billing a member that never said."""
    return prompt_chars(parsed) // routing.CHARS_PER_TOKEN


class Router:
    def __init__(self, data_dir: Path | None, now_s: float, max_entries: int = 100_000, worker: str = "") -> None:
        """``worker``: one of several gateway processes on one data directory (``--workers``) keeps its tables
        in ``routing/<worker>/`` (each learns from the requests it routes; one file each, so none overwrites
        another's), and starts from the single process's ``routing/`` tables the first time."""
        self.shared_dir = data_dir / "routing" if data_dir is not None else None
        self.dir = self.shared_dir / worker if self.shared_dir is not None and worker else self.shared_dir
        self.max_entries = max_entries
        self.affinity = AffinityTable(max_entries=max_entries)
        self.pins = PinTable(max_entries=max_entries)
        self.weights = routing.RoutingWeights()
        self.routes: dict[str, PoolRoutes] = {}
        if self.dir is not None:
            self._load(now_s)

    def _load(self, now_s: float) -> None:
        assert self.dir is not None
        for name, cls in (("affinity.json", AffinityTable), ("pins.json", PinTable)):
            path = self.dir / name
            if not path.exists() and self.shared_dir is not None:
                path = self.shared_dir / name  # a worker's first start: what the single process learnt
            if not path.exists():
                continue
            try:
                table = cls.from_json(path.read_text(), now_s, max_entries=self.max_entries)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring unreadable %s (%s); starting with an empty table", path, exc)
                continue
            setattr(self, "affinity" if cls is AffinityTable else "pins", table)
        log.info("routing tables restored: %d affinity entries", len(self.affinity))

    def snapshot(self, now_s: float) -> list[tuple[Path, str]]:
        """The tables as file texts. Taken on the event loop, which is what changes the tables: serialising
        them on another thread raced with routing ("OrderedDict mutated during iteration")."""
        if self.dir is None:
            return []
        return [(self.dir / "affinity.json", self.affinity.to_json(now_s)),
                (self.dir / "pins.json", self.pins.to_json(now_s))]

    @staticmethod
    def write(snapshot: list[tuple[Path, str]]) -> None:
        for path, text in snapshot:
            atomic_write_text(path, text)

    def save(self, now_s: float) -> None:
        self.write(self.snapshot(now_s))

    def load_of(self, kind: str, hb: SlotHeartbeat, previous: SlotHeartbeat | None) -> float | None:
        return routing.load_score(kind, hb, previous, 0, self.weights)

    def _states(self, resolved: ResolvedPool, fleet: Fleet, now_s: float) -> list[routing.MemberState]:
        out = []
        routes = self.routes.get(resolved.pool.name) or PoolRoutes()
        today = routes.today_counts(now_s)
        for ref in resolved.members:
            rec = fleet.record(ref.member_id)
            hb, previous = rec.heartbeat, rec.previous
            if ref.kind == "http" and hb is not None and hb.state == "down":
                # telemetry could not scrape it (a slow or failing /metrics): that is no signal, not a failed
                # member. Route it by the gateway's own in-flight count; its answers (connect errors, 5xx) are
                # what take it out (fleet.is_down). Issue #24: a 2.5 s /metrics made a one-member pool answer 503.
                hb, previous = None, None
            out.append(routing.MemberState(
                member_id=ref.member_id, engine_kind=hb.engine_kind if hb else "stock",
                capacity_weight=effective_weight(ref, rec.heartbeat), max_context=ref.max_context, heartbeat=hb,
                previous=previous, received_s=rec.received_s, routed_total=rec.routed_total,
                admitted=fleet.admitted(ref.member_id), in_flight=rec.in_flight,
                is_down=fleet.is_down(ref.member_id, now_s), pending_prefill_chars=rec.pending_prefill_chars,
                recent_routes=routes.recent.get(ref.member_id, 0.0), routes_today=today[ref.member_id],
                chars_per_token=rec.chars_per_token, routed_since_heartbeat=fleet.unseen(ref.member_id),
                mean_service_s=rec.mean_service_s, joules_per_output_token=rec.joules_per_output_token,
                joules_per_step=rec.joules_per_step,
                peer_unseen=fleet.peer_unseen(ref.member_id),
            ))
        return out

    def decide(self, resolved: ResolvedPool, parsed: openai_api.ParsedRequest, session_key: str | None,
               is_session_header: bool, fleet: Fleet, now_s: float, weights: routing.RoutingWeights,
               rng: random.Random) -> Decision:
        policy = policy_for(resolved.pool)
        messages = parsed.generate.messages
        keys = prefix_hashes(messages) if messages and policy.cache_affinity else ()
        request = routing.RouteRequest(session_key=session_key, is_session_header=is_session_header,
                                       prefix_keys=keys, prompt_tokens=prompt_tokens_estimate(parsed))
        self.weights = weights
        pick = routing.pick(policy, weights, self._states(resolved, fleet, now_s), request, self.affinity,
                            self.pins, now_s, rng)
        return Decision(pick, request, policy, resolved.pool.name)

    def record_success(self, decision: Decision, member_id: str, fleet: Fleet, now_s: float) -> None:
        rec = fleet.record(member_id)
        self.routes.setdefault(decision.pool, PoolRoutes()).record(member_id, now_s)
        routing.record_route(decision.policy, decision.request, decision.pick, member_id, self.affinity,
                             self.pins, now_s, routing.cache_capacity_chars(rec.heartbeat, rec.chars_per_token))

    def describe_member(self, resolved: ResolvedPool, ref: MemberRef, fleet: Fleet, now_s: float,
                        stale_after_s: float) -> dict[str, Any]:
        rec = fleet.record(ref.member_id)
        hb = rec.heartbeat
        age = None if rec.received_s is None else max(0.0, now_s - rec.received_s)
        queried = hb.prompt_tokens_queried_total if hb else None
        load = self.load_of(hb.engine_kind, hb, rec.previous) if hb else None
        return {
            "pool": resolved.pool.name, "member_id": ref.member_id, "backend": ref.backend, "transport": ref.kind,
            "engine_kind": hb.engine_kind if hb else None, "state": hb.state if hb else "unknown",
            "lanes": hb.lanes if hb else None, "running": hb.running if hb else None,
            "waiting": hb.waiting if hb else None, "kv_usage": hb.kv_usage if hb else None,
            "load_score": load, "no_signal": load is None,
            "signal_sources": hb.signal_sources if hb else None,
            # what the member serves beyond plain chat (services/gateway/capabilities.py); None: it does not say
            "capabilities": hb.capabilities if hb else None,
            "load_history": list(rec.load_history), "heartbeat_age_s": age,
            "stale": age is None or age > stale_limit_s(hb, stale_after_s), "in_flight": rec.in_flight,
            "energy_today_wh": hb.energy_today_wh if hb else None,
            "cache_hit_pct": (100.0 * (hb.prompt_tokens_hit_total or 0) / queried) if hb and queried else None,
            "capacity_weight": effective_weight(ref, hb), "down": fleet.is_down(ref.member_id, now_s),
            "chars_per_token": round(rec.chars_per_token, 3) if rec.chars_per_token else None,
            "mean_service_s": round(rec.mean_service_s, 3) if rec.mean_service_s is not None else None,
            "joules_per_output_token": rec.joules_per_output_token,
            "joules_per_step": rec.joules_per_step,
            "breaker": rec.breaker.describe(now_s),
            "breaker_state": STATE_CODE[rec.breaker.state(now_s)],
        }


def backends_view(file_config: GatewayFileConfig, fleet: Fleet, router: Router, now_s: float,
                  stale_after_s: float) -> list[dict[str, Any]]:
    """One row per member of every pool, configured pools first (``/backends``, ``/metrics``)."""
    rows = []
    names = list(file_config.pools) + [n for n in pools.model_names(file_config, fleet)
                                       if n not in file_config.pools]
    for name in names:
        resolved = pools.resolve(name, file_config, fleet)
        if resolved is None or resolved.pool.name != name:
            continue
        for ref in resolved.members:
            rows.append(router.describe_member(resolved, ref, fleet, now_s, stale_after_s))
    return rows
