"""The two base classes of every bus Struct: compact messages and JSON documents with explicit nulls."""

from __future__ import annotations

import msgspec


class Message(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Base of the msgpack messages: frozen, keyword-only, defaults left off the wire, unknown fields ignored."""


class Document(msgspec.Struct, frozen=True, kw_only=True):
    """Base of the JSON documents read by people and pages (the costs report, identity rows): every field is
    written, a null included, so a reader sees "unknown" rather than a missing key; unknown fields ignored."""
