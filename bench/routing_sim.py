"""Discrete-event routing simulation: the gateway's real ``routing.pick`` against baselines.

Four simulated engines (8 lanes, a bounded waiting queue → rejections, chunked prefill whose cost is
proportional to the *uncached* prompt tokens, batched decode whose step time grows mildly with the
batch, an LRU prefix cache in blocks) publish a heartbeat every 0.5 s. Policies:

- ``random``, ``round_robin``;
- ``least_loaded``: the native load score on the newest heartbeat, ties at random (no bookings);
- ``dynamo``: cost = uncached prefill blocks + active blocks, with exact knowledge of every engine's
  cache and queue at decision time (an upper bound on what a KV-event-fed router knows);
- ``go_gateway``: the existing gateway: a 10 s poll, ``max(score, (running + in_flight)/lanes)``,
  cache affinity keyed two or more messages deep, sticky sessions;
- ``ours``: ``services.gateway.routing.pick`` + ``record_route`` with fresh heartbeats, bookings,
  affinity (bounded per engine by the cache size its heartbeat states) and pins (imported, not
  re-implemented).

Hit rates are shown against two bounds: ``ideal`` (one infinite cache shared by the pool) and ``pooled``
(one LRU cache as big as all engines' caches together: what perfect routing could reach).

Workloads: ``shared`` (tenants sharing long system prompts, single turn), ``chat`` (multi-turn
sessions), ``unique`` (no sharing), ``bursts`` (``shared`` arriving in on/off bursts). Load is a fraction
of the pool's *nominal* capacity: its service rate under perfect caching (docs/routing.md §7).

    .venv/bin/python bench/routing_sim.py [--quick] [--markdown] [--plot docs/img/routing_sim.png]

Seeded and deterministic. The plot needs matplotlib (``pip install matplotlib``; the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from proto import EnergyReading, EnergySample, RequestTokens, SlotHeartbeat  # noqa: E402
from services.gateway.fleet import Fleet  # noqa: E402
from services.gateway.routing import (  # noqa: E402
    AffinityTable,
    MemberState,
    PinTable,
    PoolPolicy,
    RouteRequest,
    RoutingWeights,
    cache_capacity_chars,
    load_score,
    pick,
    prefix_hashes,
    record_peer_route,
    record_route,
)

# --- engine cost model -------------------------------------------------------------------------------
NUM_ENGINES = 4
LANES = 8
MAX_WAITING = 16
BLOCK_TOKENS = 32
CACHE_BLOCKS = 1024  # 32k tokens of prefix cache per engine
STEP_TOKEN_BUDGET = 2048  # chunked prefill: tokens per step (decode tokens included)
STEP_BASE_S = 0.010
STEP_PER_SEQ_S = 0.0006  # decode step time grows mildly with the batch
PREFILL_PER_TOKEN_S = 0.00008  # 12.5k prompt tok/s
HEARTBEAT_S = 0.5
GO_POLL_S = 10.0
CHARS_PER_TOKEN = 4.0  # of the simulated text (--chars-per-token): real text runs 3-6 (issue #29)
GATEWAY_ID = "gw-sim"


def service_s(uncached_tokens: int, output_tokens: int) -> float:
    """Engine time one request costs at a full batch, prefilling ``uncached_tokens``.

    The pool's nominal capacity uses the *ideal* uncached part (one infinite shared cache: the system
    prompt, or the conversation so far, is cached): the capacity the pool has under perfect routing.
    """
    step_full = STEP_BASE_S + STEP_PER_SEQ_S * LANES
    return uncached_tokens * PREFILL_PER_TOKEN_S + output_tokens * step_full / LANES


# --- requests and workloads --------------------------------------------------------------------------
@dataclass
class Session:
    """A multi-turn chat: the history grows by each reply; the next turn follows the reply + think time."""

    key: str
    system: tuple[int, int, str]  # (segment id, tokens, text)
    turns_left: int
    history: list[tuple[int, int, str, str]] = field(default_factory=list)  # (seg, tokens, role, text)


@dataclass
class Req:
    rid: int
    arrival_s: float
    session_key: str | None
    segments: list[tuple[int, int]]  # (content id, tokens): the prompt as the engine sees it
    messages: list[dict[str, str]]
    output_tokens: int
    out_seg: int
    chat: Session | None = None
    prompt_tokens: int = 0
    block_keys: list[int] = field(default_factory=list)
    engine: int = -1
    cached_tokens: int = 0
    prefill_left: int = 0
    generated: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    rejected: bool = False

    def __post_init__(self) -> None:
        self.prompt_tokens = sum(n for _, n in self.segments)
        self.block_keys = block_keys(self.segments)


def block_keys(segments: list[tuple[int, int]]) -> list[int]:
    """Chained keys of every full block: equal keys ⇔ equal token prefixes (ints hash deterministically)."""
    keys: list[int] = []
    chain = 0
    pos = 0
    for seg, n in segments:
        chain = hash((chain, seg))
        start, pos = pos, pos + n
        for end in range((start // BLOCK_TOKENS + 1) * BLOCK_TOKENS, pos + 1, BLOCK_TOKENS):
            keys.append(hash((chain, end)))
    return keys


class Texts:
    """Message texts of the right length (characters ~ 4 tokens each), made once per content id."""

    def __init__(self) -> None:
        self.next_id = 1

    def make(self, tokens: int, tag: str) -> tuple[int, int, str]:
        seg = self.next_id
        self.next_id += 1
        head = f"{tag}-{seg}:"
        return seg, tokens, head + "x" * max(0, int(tokens * CHARS_PER_TOKEN) - len(head))


@dataclass
class Workload:
    name: str
    requests: list[Req]  # open-loop arrivals (chat: each session's first turn)
    next_turn: Callable[[Req, float], Req | None]  # chat: the follow-up after a reply (None: done)
    mean_service_s: float


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (i + 1) ** s for i in range(n)]


def _arrivals(rng: random.Random, rate: float, duration_s: float, bursty: bool) -> list[float]:
    """Poisson arrivals; ``bursty``: on 1 s / off 2 s at 3x the rate, the same mean."""
    times: list[float] = []
    tau = 0.0  # bursty: time counted inside the on phases only, mapped onto the wall clock
    while True:
        tau += rng.expovariate(3 * rate if bursty else rate)
        t = (tau // 1.0) * 3.0 + tau % 1.0 if bursty else tau
        if t >= duration_s:
            return times
        times.append(t)


def make_workload(name: str, load: float, duration_s: float, seed: int) -> Workload:
    rng = random.Random(f"{name}/{load}/{seed}")
    texts = Texts()
    capacity_rps = 0.0
    if name in ("shared", "bursts"):
        tenants = [texts.make(rng.randint(1500, 3500), "system") for _ in range(32)]
        weights = _zipf_weights(len(tenants), 1.0)
        shapes = []
        for _ in range(2000):
            t = rng.choices(range(len(tenants)), weights)[0]
            shapes.append((t, rng.randint(30, 300), rng.randint(40, 200)))
        mean = sum(service_s(tenants[t][1] % BLOCK_TOKENS + u, o) for t, u, o in shapes) / len(shapes)
        capacity_rps = NUM_ENGINES / mean
        reqs = []
        for i, at in enumerate(_arrivals(rng, load * capacity_rps, duration_s, name == "bursts")):
            t, u_tokens, out = shapes[i % len(shapes)]
            sys_seg, sys_tokens, sys_text = tenants[t]
            u_seg, _, u_text = texts.make(u_tokens, "user")
            reqs.append(Req(i, at, f"tenant-{t}", [(sys_seg, sys_tokens), (u_seg, u_tokens)],
                            [{"role": "system", "content": sys_text}, {"role": "user", "content": u_text}],
                            out, texts.make(0, "out")[0]))
        return Workload(name, reqs, lambda r, now: None, mean)

    if name == "unique":
        shapes = [(rng.randint(200, 3000), rng.randint(40, 200)) for _ in range(2000)]
        mean = sum(service_s(p, o) for p, o in shapes) / len(shapes)
        capacity_rps = NUM_ENGINES / mean
        reqs = []
        for i, at in enumerate(_arrivals(rng, load * capacity_rps, duration_s, False)):
            p, out = shapes[i % len(shapes)]
            seg, _, text = texts.make(p, "user")
            reqs.append(Req(i, at, f"key-{rng.randrange(64)}", [(seg, p)], [{"role": "user", "content": text}],
                            out, texts.make(0, "out")[0]))
        return Workload(name, reqs, lambda r, now: None, mean)

    assert name == "chat"
    systems = [texts.make(rng.randint(400, 1200), "system") for _ in range(8)]
    # mean turn: system ~800 + history; estimate the service time from a sampled set of sessions
    mean_turns = 5.5
    think_mean_s = 3.0
    turn_costs = []
    for _ in range(300):
        hist = rng.randint(400, 1200)
        for _k in range(rng.randint(3, 8)):
            u, a = rng.randint(50, 300), rng.randint(80, 250)
            turn_costs.append(service_s(hist % BLOCK_TOKENS + u, a))
            hist += u + a
    mean = sum(turn_costs) / len(turn_costs)
    capacity_rps = NUM_ENGINES / mean
    session_rate = load * capacity_rps / mean_turns
    rid = iter(range(10**9))

    def turn(session: Session, at: float) -> Req:
        u_seg, u_tokens, u_text = texts.make(rng.randint(50, 300), "user")
        session.history.append((u_seg, u_tokens, "user", u_text))
        segs = [(session.system[0], session.system[1])] + [(s, n) for s, n, _, _ in session.history]
        msgs = [{"role": "system", "content": session.system[2]}]
        msgs += [{"role": role, "content": text} for _, _, role, text in session.history]
        r = Req(next(rid), at, session.key if SESSION_HEADERS else None, segs, msgs, rng.randint(80, 250),
                texts.make(0, "assistant")[0], session)
        session.turns_left -= 1
        return r

    def next_turn(prev: Req, now: float) -> Req | None:
        session = prev.chat
        assert session is not None
        if prev.rejected or session.turns_left <= 0:
            return None
        text = "assistant-" + str(prev.out_seg) + ":" + "y" * int(prev.output_tokens * CHARS_PER_TOKEN)
        session.history.append((prev.out_seg, prev.output_tokens, "assistant", text))
        return turn(session, now + rng.expovariate(1 / think_mean_s))

    reqs = []
    for i, at in enumerate(_arrivals(rng, session_rate, duration_s, False)):
        session = Session(f"chat-{i}", systems[rng.randrange(len(systems))], rng.randint(3, 8))
        reqs.append(turn(session, at))
    return Workload(name, reqs, next_turn, mean)


# --- engines -----------------------------------------------------------------------------------------
ENGINE_KIND = "native"  # --engine-kind: "native" (admitted counts per gateway) or "vllm" (vLLM's /metrics)
NUM_GATEWAYS = 1  # --gateways: replicas, each seeing only its own in-flight; requests spread over them
BUSY_WATTS: tuple[float, ...] = (300.0,)  # --busy-watts: per engine (cycled) while stepping
ENERGY_SAMPLE_S = 1.0


def gateway_id(k: int) -> str:
    return GATEWAY_ID if NUM_GATEWAYS == 1 else f"{GATEWAY_ID}-{k}"


class Engine:
    def __init__(self, idx: int) -> None:
        self.idx = idx
        self.busy_watts = BUSY_WATTS[idx % len(BUSY_WATTS)]
        self.energy_mj = 0  # cumulative, as NVML's counter: busy steps only (idle power is nobody's tokens)
        self.output_tokens = 0  # cumulative
        self.sampled_tokens = 0
        self.energy_seq = 0
        self.prefill_tokens = 0  # cumulative, for the heartbeat's measured prefill rate
        self.prefill_mark = (0.0, 0)
        self.admitted_by: dict[str, int] = {}
        self.worker_id = f"e{idx}"
        self.running: list[Req] = []
        self.waiting: deque[Req] = deque()
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.is_stepping = False
        self.admitted = 0
        self.evictions = 0  # LRU evictions of cached blocks, counted as our engine counts them
        self.seq = 0
        self.step_plan: list[tuple[Req, int]] = []

    def cached_prefix_blocks(self, keys: list[int]) -> int:
        n = 0
        for k in keys:
            if k not in self.cache:
                break
            n += 1
        return n

    def insert(self, keys: list[int]) -> None:
        for k in keys:
            if k in self.cache:
                self.cache.move_to_end(k)
            else:
                self.cache[k] = None
        while len(self.cache) > CACHE_BLOCKS:
            self.cache.popitem(last=False)
            self.evictions += 1

    def accept(self, r: Req, source: str = GATEWAY_ID) -> bool:
        if len(self.waiting) >= MAX_WAITING:
            return False
        self.admitted += 1
        self.admitted_by[source] = self.admitted_by.get(source, 0) + 1
        self.waiting.append(r)
        return True

    def start_step(self, now: float) -> float | None:
        """Admit waiting requests into free lanes, plan one step; returns its duration (None: idle)."""
        while self.waiting and len(self.running) < LANES:
            r = self.waiting.popleft()
            hit = self.cached_prefix_blocks(r.block_keys)
            for k in r.block_keys[:hit]:
                self.cache.move_to_end(k)
            r.cached_tokens = min(hit * BLOCK_TOKENS, r.prompt_tokens - 1)
            r.prefill_left = r.prompt_tokens - r.cached_tokens
            self.running.append(r)
        if not self.running:
            return None
        decoding = [r for r in self.running if r.prefill_left == 0]
        budget = STEP_TOKEN_BUDGET - len(decoding)
        plan = [(r, 1) for r in decoding]
        prefill_tokens = 0
        for r in self.running:
            if r.prefill_left > 0 and budget > 0:
                chunk = min(r.prefill_left, budget)
                budget -= chunk
                prefill_tokens += chunk
                plan.append((r, chunk))
        self.step_plan = plan
        self.prefill_tokens += prefill_tokens
        dt = STEP_BASE_S + STEP_PER_SEQ_S * len(decoding) + PREFILL_PER_TOKEN_S * prefill_tokens
        self.energy_mj += int(self.busy_watts * dt * 1000)
        self.output_tokens += len(decoding)
        return dt

    def finish_step(self, now: float) -> tuple[list[Req], list[Req]]:
        """Apply the planned step: (requests that streamed their first token, requests that finished)."""
        started: list[Req] = []
        done: list[Req] = []
        for r, n in self.step_plan:
            if r.prefill_left > 0:
                r.prefill_left -= n
                if r.prefill_left == 0:
                    r.first_token_s = now
                    started.append(r)
                    r.generated = 1
                    self.insert(r.block_keys)
            else:
                r.generated += 1
            if r.prefill_left == 0 and r.generated >= r.output_tokens:
                r.finish_s = now
                done.append(r)
        if done:
            self.running = [r for r in self.running if r.finish_s is None]
            for r in done:  # the reply's full blocks are cached too (the next chat turn can hit them)
                self.insert(block_keys([*r.segments, (r.out_seg, r.output_tokens)])[len(r.block_keys):])
        return started, done

    def heartbeat(self, now: float) -> SlotHeartbeat:
        self.seq += 1
        used = sum(r.prompt_tokens + r.generated for r in self.running) / BLOCK_TOKENS
        t0, n0 = self.prefill_mark
        self.prefill_mark = (now, self.prefill_tokens)
        prefill_rate = (self.prefill_tokens - n0) / (now - t0) if now > t0 else None
        if ENGINE_KIND == "vllm":
            # what telemetry's vllm_reading makes of vLLM's /metrics: running/waiting, kv_cache_usage_perc,
            # num_gpu_blocks x block_size from cache_config_info, max_num_seqs as lanes; no admitted counts, no
            # eviction counter, no prefill rate
            return SlotHeartbeat(
                worker_id=self.worker_id, session_id="s", seq=self.seq, ts_s=now, model_id="m", engine_kind="vllm",
                backend="http", lanes=LANES, running=len(self.running), waiting=len(self.waiting),
                kv_usage=min(used / CACHE_BLOCKS, 1.0), kv_blocks_total=CACHE_BLOCKS,
                kv_capacity_tokens=CACHE_BLOCKS * BLOCK_TOKENS, heartbeat_interval_s=HEARTBEAT_S,
            )
        return SlotHeartbeat(
            worker_id=self.worker_id, session_id="s", seq=self.seq, ts_s=now, model_id="m", engine_kind="native",
            lanes=LANES, running=len(self.running), waiting=len(self.waiting), max_pending=MAX_WAITING,
            kv_usage=min(used / CACHE_BLOCKS, 1.0), kv_evictions_total=self.evictions, admitted_total=self.admitted,
            admitted_by_gateway=dict(self.admitted_by), kv_capacity_tokens=CACHE_BLOCKS * BLOCK_TOKENS,
            prefill_tok_per_s=prefill_rate, heartbeat_interval_s=HEARTBEAT_S,
        )

    def energy_sample(self, now: float) -> EnergySample:
        """As the engine's energy sampler: the raw cumulative counter and the output tokens since the last one."""
        self.energy_seq += 1
        tokens, self.sampled_tokens = self.output_tokens - self.sampled_tokens, self.output_tokens
        return EnergySample(worker_id=self.worker_id, session_id="s", seq=self.energy_seq, ts_s=now, model_id="m",
                            readings=[EnergyReading(device_id=f"gpu-{self.idx}", kind="nvml", method="counter",
                                                    energy_mj=self.energy_mj)],
                            request_tokens=[RequestTokens(request_id="interval", output_tokens=tokens)])


# --- policies ----------------------------------------------------------------------------------------
class Policy:
    """What a gateway sees: heartbeats it received, its own open requests; picks an engine index."""

    name = "policy"

    def __init__(self, engines: list[Engine], rng: random.Random) -> None:
        self.engines = engines
        self.rng = rng
        self.hb: list[SlotHeartbeat | None] = [None] * len(engines)
        self.prev: list[SlotHeartbeat | None] = [None] * len(engines)
        self.hb_s: list[float | None] = [None] * len(engines)
        self.in_flight = [0] * len(engines)
        self.routed = [0] * len(engines)

    _now = 0.0  # the event loop's clock at the current arrival (book() has no time argument)

    def on_heartbeat(self, i: int, hb: SlotHeartbeat, now: float) -> None:
        self.prev[i], self.hb[i], self.hb_s[i] = self.hb[i], hb, now

    def on_energy(self, sample: EnergySample) -> None:
        pass

    def finished(self, r: Req, now: float) -> None:
        pass

    def choose(self, r: Req, now: float) -> int:
        raise NotImplementedError

    def routed_ok(self, r: Req, i: int, now: float) -> None:
        pass

    def first_token(self, r: Req, now: float) -> None:
        pass

    def book(self, i: int) -> None:
        self.in_flight[i] += 1
        self.routed[i] += 1

    def unbook(self, i: int, *, admitted: bool) -> None:
        self.in_flight[i] -= 1
        if not admitted:  # a 429 before admission: the engine will never count it
            self.routed[i] -= 1


class RandomPolicy(Policy):
    name = "random"

    def choose(self, r: Req, now: float) -> int:
        return self.rng.randrange(len(self.engines))


class RoundRobin(Policy):
    name = "round_robin"
    _next = 0

    def choose(self, r: Req, now: float) -> int:
        i = self._next
        self._next = (i + 1) % len(self.engines)
        return i


class LeastLoaded(Policy):
    name = "least_loaded"
    weights = RoutingWeights()

    def choose(self, r: Req, now: float) -> int:
        scores = []
        for i, hb in enumerate(self.hb):
            s = load_score(hb.engine_kind, hb, self.prev[i], 0, self.weights) if hb is not None else 0.0
            scores.append(s or 0.0)
        best = min(scores)
        return self.rng.choice([i for i, s in enumerate(scores) if s == best])


class Dynamo(Policy):
    """Exact cache and queue knowledge: cost = uncached prefill blocks + active (running + waiting) blocks."""

    name = "dynamo"

    def choose(self, r: Req, now: float) -> int:
        costs = []
        for e in self.engines:
            uncached = len(r.block_keys) - e.cached_prefix_blocks(r.block_keys)
            active = sum(x.prompt_tokens + x.generated for x in (*e.running, *e.waiting)) / BLOCK_TOKENS
            costs.append(uncached + active)
        best = min(costs)
        return self.rng.choice([i for i, c in enumerate(costs) if c == best])


class GoGateway(Policy):
    """The existing gateway: a 10 s poll, the double-counting blend, affinity 2+ deep, sticky sessions."""

    name = "go_gateway"
    overflow = 0.85
    weights = RoutingWeights()

    def __init__(self, engines: list[Engine], rng: random.Random) -> None:
        super().__init__(engines, rng)
        self.polled: list[SlotHeartbeat | None] = [None] * len(engines)
        self.polled_s = -1e9
        self.affinity: dict[str, int] = {}
        self.sticky: dict[str, int] = {}

    def score(self, i: int) -> float:
        hb = self.polled[i]
        if hb is None or hb.lanes is None or hb.running is None:
            return 0.0
        s = load_score(hb.engine_kind, hb, None, 0, self.weights) or 0.0
        return max(s, (hb.running + self.in_flight[i]) / hb.lanes)

    def choose(self, r: Req, now: float) -> int:
        if now - self.polled_s >= GO_POLL_S:
            self.polled, self.polled_s = list(self.hb), now
        scores = [self.score(i) for i in range(len(self.engines))]
        if r.session_key is not None and r.session_key in self.sticky:
            i = self.sticky[r.session_key]
            if scores[i] < self.overflow:
                return i
        for key in reversed(prefix_hashes(r.messages)[1:]):  # keyed two or more messages deep
            i = self.affinity.get(key.digest, -1)
            if i >= 0:
                if scores[i] < self.overflow:
                    return i
                break
        open_ = [i for i, s in enumerate(scores) if s < self.overflow] or list(range(len(scores)))
        return min(open_, key=lambda i: (scores[i], i))

    def routed_ok(self, r: Req, i: int, now: float) -> None:
        for key in prefix_hashes(r.messages)[1:]:
            self.affinity[key.digest] = i
        if r.session_key is not None:
            self.sticky[r.session_key] = i


class Ours(Policy):
    """The gateway's router over the gateway's own bookkeeping: a :class:`Fleet` fed heartbeats, bookings at
    routing, releases at the end (with the request's service time) and energy samples, members built as
    ``routing_adapter.Router._states`` builds them, affinity and pins recorded at the first byte."""

    name = "ours"

    def __init__(self, engines: list[Engine], rng: random.Random, policy: PoolPolicy | None = None,
                 gateway: str = GATEWAY_ID) -> None:
        super().__init__(engines, rng)
        self.policy = policy or PoolPolicy()
        self.weights = RoutingWeights()
        self.affinity = AffinityTable(max_entries=200_000, ttl_s=600.0)
        self.pins = PinTable(max_entries=100_000, ttl_s=1800.0)
        self.ids = [e.worker_id for e in engines]
        self.index = {w: i for i, w in enumerate(self.ids)}
        self._last: tuple[RouteRequest, object] | None = None
        self.expected_chars: dict[int, tuple[int, int]] = {}  # rid → (engine, uncached chars expected)
        self.picks: dict[int, tuple[RouteRequest, object]] = {}  # rid → its routing decision, until first byte
        self.routed_s: dict[int, float] = {}
        self.fleet = Fleet(gateway)

    def on_heartbeat(self, i: int, hb: SlotHeartbeat, now: float) -> None:
        super().on_heartbeat(i, hb, now)
        self.fleet.observe(hb, now)

    def on_energy(self, sample: EnergySample) -> None:
        self.fleet.note_energy(sample)

    def choose(self, r: Req, now: float) -> int:
        members = []
        for wid in self.ids:
            rec = self.fleet.record(wid)
            members.append(MemberState(
                member_id=wid, engine_kind=rec.heartbeat.engine_kind if rec.heartbeat else "stock",
                capacity_weight=LANES, heartbeat=rec.heartbeat, previous=rec.previous, received_s=rec.received_s,
                routed_total=rec.routed_total, admitted=self.fleet.admitted(wid), in_flight=rec.in_flight,
                pending_prefill_chars=rec.pending_prefill_chars, chars_per_token=rec.chars_per_token,
                routed_since_heartbeat=self.fleet.unseen(wid), mean_service_s=rec.mean_service_s,
                joules_per_output_token=rec.joules_per_output_token, joules_per_step=rec.joules_per_step,
                peer_unseen=self.fleet.peer_unseen(wid),
            ))
        request = RouteRequest(session_key=r.session_key, is_session_header=r.chat is not None,
                               prefix_keys=prefix_hashes(r.messages), prompt_tokens=r.prompt_tokens)
        p = pick(self.policy, self.weights, members, request, self.affinity, self.pins, now, self.rng)
        assert p.member_id is not None
        self._last = (request, p)
        return self.index[p.member_id]

    peers: tuple[Ours, ...] = ()  # --share: the other replicas, told of each route and first byte (RouteNotes)

    def book(self, i: int) -> None:
        super().book(i)
        self.fleet.book(self.ids[i], self._now)
        for peer in self.peers:
            peer.fleet.note_peer_route(self.ids[i], self._now)

    def routed_ok(self, r: Req, i: int, now: float) -> None:
        assert self._last is not None
        request, p = self._last
        hit = next(c.affinity_chars for c in p.candidates if c.member_id == self.ids[i])  # type: ignore[attr-defined]
        chars = request.prefix_keys[-1].prefix_chars - hit if request.prefix_keys else 0
        self.expected_chars[r.rid] = (i, chars)
        self.fleet.add_pending_prefill(self.ids[i], chars)
        for peer in self.peers:  # RouteNote "routed" carries the prefill it queues
            peer.fleet.add_pending_prefill(self.ids[i], chars)
        self.picks[r.rid] = (request, p)
        self.routed_s[r.rid] = now

    def unbook(self, i: int, *, admitted: bool) -> None:
        super().unbook(i, admitted=admitted)
        if not admitted:
            self.fleet.unbook(self.ids[i])
            self.fleet.release(self.ids[i])

    def finished(self, r: Req, now: float) -> None:
        self.fleet.release(self.ids[r.engine], now - self.routed_s.pop(r.rid))

    def first_token(self, r: Req, now: float) -> None:
        # the gateway's order (services/gateway/forwarder.py): affinity and pins recorded at the first byte
        i, chars = self.expected_chars.pop(r.rid)
        self.fleet.add_pending_prefill(self.ids[i], -chars)
        for peer in self.peers:  # ... and "prefill_done" takes it off
            peer.fleet.add_pending_prefill(self.ids[i], -chars)
        request, p = self.picks.pop(r.rid)
        rec = self.fleet.record(self.ids[i])
        capacity = cache_capacity_chars(rec.heartbeat, rec.chars_per_token)
        record_route(self.policy, request, p, self.ids[i], self.affinity, self.pins, now,  # type: ignore[arg-type]
                     capacity)
        for peer in self.peers:
            key = request.session_key if request.is_session_header else None
            record_peer_route(peer.policy, request.prefix_keys, key, self.ids[i], peer.affinity, peer.pins, now,
                              capacity)
        self.fleet.note_prompt(self.ids[i], sum(len(m["content"]) for m in r.messages), r.prompt_tokens)


class OursEnergy(Ours):
    """``ours`` with the energy tie-break on (energy_margin 0.1; the default is off): compare with --busy-watts."""

    name = "ours_energy"

    def __init__(self, engines: list[Engine], rng: random.Random, gateway: str = GATEWAY_ID) -> None:
        super().__init__(engines, rng, PoolPolicy(energy_margin=0.1), gateway)


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (RandomPolicy, RoundRobin, LeastLoaded, Dynamo, GoGateway, Ours, OursEnergy)
}
DEFAULT_POLICIES = ("random", "round_robin", "least_loaded", "dynamo", "go_gateway", "ours")
SESSION_HEADERS = True  # --no-session-header: chat requests carry no X-Session-Id
SHARE_ROUTES = True  # --no-share: gateway replicas do not exchange RouteNotes


# --- the event loop ----------------------------------------------------------------------------------
@dataclass
class Result:
    workload: str
    load: float
    policy: str
    ttft_p50_ms: float
    ttft_p90_ms: float
    throughput_rps: float
    prefix_hit_pct: float
    ideal_hit_pct: float
    pooled_hit_pct: float
    rejected: int
    requests: int
    j_per_output_token: float = float("nan")
    ttft_p99_ms: float = float("nan")


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def simulate(workload_name: str, load: float, policy_name: str, duration_s: float, seed: int,
             warmup_s: float) -> Result:
    wl = make_workload(workload_name, load, duration_s, seed)
    engines = [Engine(i) for i in range(NUM_ENGINES)]
    cls = POLICIES[policy_name]
    # several gateways: each its own instance (its own in-flight, tables and fleet view); requests spread over
    # them at random, as a load balancer in front would
    gateways = [cls(engines, random.Random(f"{seed}/{k}"), gateway=gateway_id(k)) if issubclass(cls, Ours)
                else cls(engines, random.Random(f"{seed}/{k}")) for k in range(NUM_GATEWAYS)]
    if SHARE_ROUTES:
        for g in gateways:
            if isinstance(g, Ours):
                g.peers = tuple(x for x in gateways if x is not g and isinstance(x, Ours))
    spread = random.Random(f"spread/{seed}")
    gateway_of: dict[int, Policy] = {}
    events: list[tuple[float, int, int, object]] = []  # (time, seq, kind, payload)
    seq = 0
    arrival, step_end, heartbeat, energy = 0, 1, 2, 3

    def push(t: float, kind: int, payload: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    for r in wl.requests:
        push(r.arrival_s, arrival, r)
    for e in engines:
        push(e.idx * HEARTBEAT_S / NUM_ENGINES, heartbeat, e)
        push(ENERGY_SAMPLE_S * (1 + e.idx / NUM_ENGINES), energy, e)
    done: list[Req] = []
    end_s = duration_s + 120.0  # drain

    def kick(e: Engine, now: float) -> None:
        if not e.is_stepping:
            dt = e.start_step(now)
            if dt is not None:
                e.is_stepping = True
                push(now + dt, step_end, e)

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if now > end_s:
            break
        if kind == arrival:
            r = payload
            assert isinstance(r, Req)
            policy = gateway_of[r.rid] = gateways[spread.randrange(NUM_GATEWAYS)]
            policy._now = now
            i = policy.choose(r, now)
            policy.book(i)
            r.engine = i
            if engines[i].accept(r, gateway_id(gateways.index(policy))):
                policy.routed_ok(r, i, now)
                kick(engines[i], now)
            else:
                r.rejected = True
                policy.unbook(i, admitted=False)
                del gateway_of[r.rid]
                done.append(r)
                nxt = wl.next_turn(r, now)
                if nxt is not None:
                    push(nxt.arrival_s, arrival, nxt)
        elif kind == step_end:
            e = payload
            assert isinstance(e, Engine)
            e.is_stepping = False
            started, finished = e.finish_step(now)
            for r in started:
                gateway_of[r.rid].first_token(r, now)
            for r in finished:
                policy = gateway_of.pop(r.rid)
                policy.unbook(r.engine, admitted=True)
                policy.finished(r, now)
                done.append(r)
                nxt = wl.next_turn(r, now)
                if nxt is not None and nxt.arrival_s < duration_s:
                    push(nxt.arrival_s, arrival, nxt)
            kick(e, now)
        elif kind == heartbeat:
            e = payload
            assert isinstance(e, Engine)
            hb = e.heartbeat(now)
            for g in gateways:
                g.on_heartbeat(e.idx, hb, now)
            if now < duration_s + 60:
                push(now + HEARTBEAT_S, heartbeat, e)
        else:
            e = payload
            assert isinstance(e, Engine)
            sample = e.energy_sample(now)
            for g in gateways:
                g.on_energy(sample)
            if now < duration_s + 60:
                push(now + ENERGY_SAMPLE_S, energy, e)

    measured = [r for r in done if r.arrival_s >= warmup_s]
    served = [r for r in measured if not r.rejected]
    ttfts = sorted((r.first_token_s - r.arrival_s) * 1000 for r in served if r.first_token_s is not None)
    prompt = sum(r.prompt_tokens for r in served)
    cached = sum(r.cached_tokens for r in served)
    last = max((r.finish_s for r in served if r.finish_s is not None), default=duration_s)
    return Result(workload_name, load, policy_name, _pct(ttfts, 0.5), _pct(ttfts, 0.9),
                  len(served) / max(last - warmup_s, 1e-9), 100 * cached / max(prompt, 1),
                  ideal_hit_pct(done, warmup_s), ideal_hit_pct(done, warmup_s, NUM_ENGINES * CACHE_BLOCKS),
                  sum(r.rejected for r in measured), len(measured),
                  sum(e.energy_mj for e in engines) / 1000 / max(1, sum(e.output_tokens for e in engines)),
                  _pct(ttfts, 0.99))


def ideal_hit_pct(done: list[Req], warmup_s: float, cache_blocks: int | None = None) -> float:
    """Hits of one cache shared by the whole pool, requests in arrival order: every full block seen earlier
    is a hit (``cache_blocks`` None: an infinite cache; else an LRU of that many blocks, e.g. all engines'
    caches pooled, which no router over separate engines can beat)."""
    seen: OrderedDict[int, None] = OrderedDict()

    def touch(keys: list[int]) -> None:
        for k in keys:
            seen[k] = None
            seen.move_to_end(k)
        while cache_blocks is not None and len(seen) > cache_blocks:
            seen.popitem(last=False)

    prompt = hit = 0
    for r in sorted(done, key=lambda x: x.arrival_s):
        n = 0
        for k in r.block_keys:
            if k not in seen:
                break
            n += 1
        if r.arrival_s >= warmup_s and not r.rejected:
            prompt += r.prompt_tokens
            hit += min(n * BLOCK_TOKENS, r.prompt_tokens - 1)
        touch(r.block_keys)
        if r.chat is not None and not r.rejected:
            touch(block_keys([*r.segments, (r.out_seg, r.output_tokens)]))
    return 100 * hit / max(prompt, 1)


# --- report ------------------------------------------------------------------------------------------
WORKLOADS = ("shared", "chat", "unique", "bursts")
LOADS = (0.5, 0.8, 0.95)


def table(results: list[Result], markdown: bool) -> str:
    head = ["workload", "load", "policy", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "req/s", "prefix hit %",
            "ideal %", "pooled %", "rejected", "requests", "J/out tok"]
    rows = [[r.workload, f"{r.load:.2f}", r.policy, f"{r.ttft_p50_ms:.0f}", f"{r.ttft_p90_ms:.0f}",
             f"{r.ttft_p99_ms:.0f}", f"{r.throughput_rps:.2f}", f"{r.prefix_hit_pct:.1f}", f"{r.ideal_hit_pct:.1f}",
             f"{r.pooled_hit_pct:.1f}",
             str(r.rejected), str(r.requests), f"{r.j_per_output_token:.3f}"] for r in results]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)) for row in [head, *rows])


def verdict(results: list[Result]) -> list[str]:
    """Cells where ours is not at or below the best baseline's TTFT p90 (and ours vs round-robin)."""
    notes = []
    cells = sorted({(r.workload, r.load) for r in results}, key=lambda c: (WORKLOADS.index(c[0]), c[1]))
    for wl, load in cells:
        cell = {r.policy: r for r in results if r.workload == wl and r.load == load}
        if "ours" not in cell:
            continue
        ours = cell["ours"]
        baselines = [r for p, r in cell.items() if not p.startswith("ours")]
        if not baselines:
            continue
        best = min(baselines, key=lambda r: r.ttft_p90_ms)
        rr = cell.get("round_robin")
        ratio = f", round-robin/ours p90 = {rr.ttft_p90_ms / ours.ttft_p90_ms:.1f}x" if rr else ""
        mark = "ok  " if ours.ttft_p90_ms <= best.ttft_p90_ms * 1.0 else "LOSS"
        notes.append(f"{mark} {wl:>7} @ {load:.2f}: ours p90 {ours.ttft_p90_ms:.0f} ms vs best baseline "
                     f"{best.policy} {best.ttft_p90_ms:.0f} ms{ratio}")
    return notes


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(4.2 * len(WORKLOADS), 3.8), sharey=False)
    policies = list(dict.fromkeys(r.policy for r in results))
    for ax, wl in zip(axes, WORKLOADS, strict=True):
        for p in policies:
            pts = sorted((r.load, r.ttft_p90_ms) for r in results if r.workload == wl and r.policy == p)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p,
                        linewidth=2.5 if p == "ours" else 1.2)
        ax.set_title(wl)
        ax.set_xlabel("offered load (fraction of nominal capacity)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("TTFT p90 (ms, log)")
    axes[-1].legend(fontsize=8)
    fig.suptitle("bench/routing_sim.py: 4 engines x 8 lanes, TTFT p90 by workload, load and policy")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="60 s of arrivals instead of 240 s")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--plot", type=Path, default=REPO / "docs/img/routing_sim.png")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--loads", default=",".join(str(x) for x in LOADS))
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help=f"of {', '.join(POLICIES)}")
    ap.add_argument("--gateways", type=int, default=1, help="gateway replicas, each seeing only its own in-flight")
    ap.add_argument("--engine-kind", choices=("native", "vllm"), default="native",
                    help="how engines report: our engine's heartbeat, or vLLM's /metrics as telemetry normalizes it")
    ap.add_argument("--heartbeat-s", type=float, default=HEARTBEAT_S)
    ap.add_argument("--no-share", action="store_true", help="replicas do not share routes (RouteNotes)")
    ap.add_argument("--no-session-header", action="store_true", help="chat requests carry no X-Session-Id")
    ap.add_argument("--busy-watts", default="300",
                    help="per-engine power while stepping, comma-separated, cycled (e.g. 300,300,200,200)")
    ap.add_argument("--chars-per-token", type=float, default=4.0,
                    help="characters per token of the simulated text (real text: 3-6)")
    args = ap.parse_args(argv)
    globals().update(CHARS_PER_TOKEN=args.chars_per_token, NUM_GATEWAYS=args.gateways, ENGINE_KIND=args.engine_kind,
                     HEARTBEAT_S=args.heartbeat_s, SESSION_HEADERS=not args.no_session_header,
                     SHARE_ROUTES=not args.no_share,
                     BUSY_WATTS=tuple(float(w) for w in args.busy_watts.split(",")))
    duration_s, warmup_s = (60.0, 10.0) if args.quick else (240.0, 20.0)
    results = []
    t0 = time.perf_counter()
    for wl in args.workloads.split(","):
        for load in (float(x) for x in args.loads.split(",")):
            for p in args.policies.split(","):
                results.append(simulate(wl, load, p, duration_s, args.seed, warmup_s))
    print(table(results, args.markdown))
    print()
    for line in verdict(results):
        print(line)
    print(f"\n{len(results)} runs in {time.perf_counter() - t0:.1f} s (seed {args.seed}, {duration_s:.0f} s arrivals, "
          f"{args.chars_per_token:g} characters per token, {args.gateways} gateway(s), {args.engine_kind} engines, "
          f"{args.heartbeat_s:g} s heartbeats, session headers {'off' if args.no_session_header else 'on'}, "
          f"busy watts {args.busy_watts})")
    if not args.no_plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

