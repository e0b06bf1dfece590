"""The gateway's routing memory: prefix keys, the cache-affinity table and the session-pin table.

Pure data structures (docs/routing.md §4, §5): no clock or I/O of their own; every call takes ``now_s``
in the caller's clock (use wall time, ``time.time()``, if the tables are persisted across restarts).
``pick`` only reads them (``lookup``/``lookup_members``/``get``); the caller writes after a successful
route, through ``routing.record_route`` (which calls ``AffinityTable.record`` and ``PinTable.pin``).

Prefix keys: a chained blake2b over the conversation, one key per depth, *including the system prompt
alone* (depth 1), so single-turn requests that share only a long system prompt still match::

    d_i = blake2b(role_i "\\0" name_i "\\0" content_i)          (16 bytes)
    h_1 = blake2b(d_1),   h_k = blake2b(h_{k-1} ‖ d_k)
    chars_k = Σ_{i≤k} len(content_i)                      (a cost proxy for prefill tokens)
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Any, NamedTuple

_DIGEST_BYTES = 16
_TABLE_SCHEMA = 1
# How many members one prefix key credits (the most recent ones). Tuned with bench/routing_sim.py
# (docs/routing.md §7): 1 forgets that earlier holders still hold a popular prefix, and misroutes around them.
MEMBERS_PER_KEY = 4


class PrefixKey(NamedTuple):
    """The conversation's first ``depth`` messages: ``digest`` (hex) and their length in characters."""

    digest: str
    depth: int
    prefix_chars: int


class AffinityHit(NamedTuple):
    member_id: str
    depth: int
    prefix_chars: int


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # OpenAI content parts (text / image_url …): a canonical encoding, so equal parts hash equally.
    return json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _fields(message: Any) -> tuple[str, str, str]:
    if isinstance(message, Mapping):
        return str(message.get("role", "")), str(message.get("name") or ""), _content_text(message.get("content"))
    return str(message.role), str(getattr(message, "name", None) or ""), _content_text(message.content)


def prefix_hashes(messages: Sequence[Any]) -> tuple[PrefixKey, ...]:
    """One key per depth 1..len(messages); messages are dicts (OpenAI JSON) or ``proto.ChatMessage``."""
    keys: list[PrefixKey] = []
    chain = b""
    chars = 0
    for depth, message in enumerate(messages, start=1):
        role, name, content = _fields(message)
        digest = blake2b(f"{role}\0{name}\0{content}".encode(), digest_size=_DIGEST_BYTES).digest()
        chain = blake2b(chain + digest, digest_size=_DIGEST_BYTES).digest()
        chars += len(content)
        keys.append(PrefixKey(chain.hex(), depth, chars))
    return tuple(keys)


@dataclass
class _Entry:
    depth: int
    prefix_chars: int
    own_chars: int  # this depth's message alone: what the prefix adds over its parent
    members: dict[str, float] = field(default_factory=dict)  # member → last recorded (oldest first)


class AffinityTable:
    """Prefix key → the members that served it recently. LRU over keys (``max_entries``) plus a TTL.

    Each key remembers up to ``max_members_per_key`` members (most recent last): when load spreads a
    popular prefix over several members, every one of them holds it, and each is credited. Each member's
    credit is also bounded by its cache size when the caller knows it (``record(capacity_chars=…)``): the
    member's least recently recorded prefixes beyond that are forgotten for it, as its engine evicts them.
    Lookups cost O(len(keys) · max_members_per_key), never a scan of the table; a record, O(len(keys))
    plus what it forgets.
    """

    def __init__(self, max_entries: int = 100_000, ttl_s: float = 600.0,
                 max_members_per_key: int = MEMBERS_PER_KEY) -> None:
        if max_entries < 1 or ttl_s <= 0 or max_members_per_key < 1:
            raise ValueError("AffinityTable: max_entries, ttl_s and max_members_per_key must be positive")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.max_members_per_key = max_members_per_key
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        # per member: the prefixes it holds in its own LRU order (digest → own chars) and their sum, so a
        # member's share of the table can be bounded by what its cache holds (``record(capacity_chars=…)``)
        self._held: dict[str, OrderedDict[str, int]] = {}
        self._held_chars: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _is_live(self, t_s: float, now_s: float) -> bool:
        return now_s - t_s <= self.ttl_s

    def lookup(self, keys: Sequence[PrefixKey], now_s: float) -> AffinityHit | None:
        """The deepest live entry and its most recent member, or None. Does not touch the LRU order."""
        for key in reversed(keys):
            entry = self._entries.get(key.digest)
            if entry is None:
                continue
            for member_id, t_s in reversed(entry.members.items()):
                if self._is_live(t_s, now_s):
                    return AffinityHit(member_id, key.depth, key.prefix_chars)
        return None

    def lookup_members(self, keys: Sequence[PrefixKey], now_s: float) -> dict[str, AffinityHit]:
        """Each member's deepest live entry among ``keys``. Does not touch the LRU order."""
        hits: dict[str, AffinityHit] = {}
        for key in reversed(keys):
            entry = self._entries.get(key.digest)
            if entry is None:
                continue
            for member_id, t_s in entry.members.items():
                if member_id not in hits and self._is_live(t_s, now_s):
                    hits[member_id] = AffinityHit(member_id, key.depth, key.prefix_chars)
        return hits

    def record(self, keys: Sequence[PrefixKey], member_id: str, now_s: float,
               capacity_chars: int | None = None) -> None:
        """``member_id`` served a request with these keys (every depth): it now holds each prefix.

        ``capacity_chars``: how much prompt text the member's prefix cache holds (docs/routing.md §4). The
        member's least recently used prefixes beyond it are forgotten for that member, the deepest first
        within one request (an engine's LRU cache evicts a sequence's tail blocks before its head).
        """
        held = self._held.setdefault(member_id, OrderedDict())
        parent_chars = 0
        for key in keys:
            own = key.prefix_chars - parent_chars
            parent_chars = key.prefix_chars
            entry = self._entries.get(key.digest)
            if entry is None:
                entry = self._entries[key.digest] = _Entry(key.depth, key.prefix_chars, own)
            else:
                self._entries.move_to_end(key.digest)
                entry.members.pop(member_id, None)
            entry.members[member_id] = now_s
            while len(entry.members) > self.max_members_per_key:
                self._release(next(iter(entry.members)), key.digest, entry)
        for key in reversed(keys):  # the head of the conversation is the most recently used
            if key.digest in held:
                held.move_to_end(key.digest)
            else:
                held[key.digest] = self._entries[key.digest].own_chars
                self._held_chars[member_id] = self._held_chars.get(member_id, 0) + held[key.digest]
        if capacity_chars is not None:
            while self._held_chars.get(member_id, 0) > capacity_chars and len(held) > 1:
                digest = next(iter(held))
                self._release(member_id, digest, self._entries.get(digest))
        while len(self._entries) > self.max_entries:
            digest, entry = self._entries.popitem(last=False)
            for m in list(entry.members):
                self._release(m, digest, None)

    def _release(self, member_id: str, digest: str, entry: _Entry | None) -> None:
        """The table no longer credits ``member_id`` with ``digest`` (an entry left empty is dropped)."""
        held = self._held.get(member_id)
        if held is not None and digest in held:
            self._held_chars[member_id] -= held.pop(digest)
        if entry is not None:
            entry.members.pop(member_id, None)
            if not entry.members:
                del self._entries[digest]

    def held_chars(self, member_id: str) -> int:
        """The prompt text the table credits ``member_id`` with holding."""
        return self._held_chars.get(member_id, 0)

    def forget_member(self, member_id: str) -> None:
        """The member lost its cache (restart, removal). O(table): call on such events, never per request."""
        for digest in list(self._entries):
            entry = self._entries[digest]
            entry.members.pop(member_id, None)
            if not entry.members:
                del self._entries[digest]
        self._held.pop(member_id, None)
        self._held_chars.pop(member_id, None)

    def to_json(self, now_s: float) -> str:
        """Entries in LRU order (oldest first) with each member's age at ``now_s``."""
        entries = [
            [digest, e.depth, e.prefix_chars, [[m, round(now_s - t, 3)] for m, t in e.members.items()], e.own_chars]
            for digest, e in self._entries.items()
        ]
        return json.dumps({"schema": _TABLE_SCHEMA, "saved_at_s": now_s, "entries": entries}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, now_s: float, max_entries: int = 100_000, ttl_s: float = 600.0,
                  max_members_per_key: int = MEMBERS_PER_KEY) -> AffinityTable:
        """Entries keep their age (plus the time since saving); expired ones are dropped.

        Each member's holdings are rebuilt in the order they were recorded (a row without its own-chars
        figure, from an older file, counts its whole prefix). Raises ValueError on a file of another
        schema or shape (the caller starts empty).
        """
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("schema") != _TABLE_SCHEMA:
            raise ValueError("affinity table: unknown schema")
        table = cls(max_entries, ttl_s, max_members_per_key)
        downtime_s = max(0.0, now_s - float(data["saved_at_s"]))
        for digest, depth, chars, members, *rest in data["entries"]:
            live = {str(m): now_s - float(age) - downtime_s for m, age in members}
            live = {m: t for m, t in live.items() if table._is_live(t, now_s)}
            if live:
                own = int(rest[0]) if rest else int(chars)
                table._entries[str(digest)] = _Entry(int(depth), int(chars), own, live)
        while len(table._entries) > table.max_entries:
            table._entries.popitem(last=False)
        # one record() stamps a request's keys alike and holds the deepest first (see record)
        held = sorted((t, -e.depth, digest, m) for digest, e in table._entries.items() for m, t in e.members.items())
        for _, _, digest, m in held:
            table._held.setdefault(m, OrderedDict())[digest] = own = table._entries[digest].own_chars
            table._held_chars[m] = table._held_chars.get(m, 0) + own
        return table


class PinTable:
    """Session key (``X-Session-Id``, else the API key id) → member. LRU (``max_entries``) plus a TTL."""

    def __init__(self, max_entries: int = 100_000, ttl_s: float = 1800.0) -> None:
        if max_entries < 1 or ttl_s <= 0:
            raise ValueError("PinTable: max_entries and ttl_s must be positive")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._pins: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pins)

    def get(self, session_key: str, now_s: float) -> str | None:
        """The pinned member while the pin is live. Does not touch the LRU order."""
        pin = self._pins.get(session_key)
        if pin is None or now_s - pin[1] > self.ttl_s:
            return None
        return pin[0]

    def pin(self, session_key: str, member_id: str, now_s: float) -> None:
        """Pin (or re-pin, or refresh) a session; the LRU-oldest pin goes when the table is full."""
        self._pins.pop(session_key, None)
        self._pins[session_key] = (member_id, now_s)
        while len(self._pins) > self.max_entries:
            self._pins.popitem(last=False)

    def unpin(self, session_key: str) -> None:
        self._pins.pop(session_key, None)

    def to_json(self, now_s: float) -> str:
        pins = [[k, m, round(now_s - t, 3)] for k, (m, t) in self._pins.items()]
        return json.dumps({"schema": _TABLE_SCHEMA, "saved_at_s": now_s, "pins": pins}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, now_s: float, max_entries: int = 100_000, ttl_s: float = 1800.0) -> PinTable:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("schema") != _TABLE_SCHEMA:
            raise ValueError("pin table: unknown schema")
        table = cls(max_entries, ttl_s)
        downtime_s = max(0.0, now_s - float(data["saved_at_s"]))
        for key, member_id, age in data["pins"]:
            t_s = now_s - float(age) - downtime_s
            if now_s - t_s <= ttl_s:
                table._pins[str(key)] = (str(member_id), t_s)
        while len(table._pins) > table.max_entries:
            table._pins.popitem(last=False)
        return table
