"""The two bases every proto Struct derives from: a bus message, and a document people read."""

from __future__ import annotations

import msgspec


class Message(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A bus message: frozen, keyword-only, defaults left off the wire, unknown fields ignored on decode.

    Subclasses repeat ``frozen=True``: msgspec inherits it anyway, and mypy's dataclass model needs it written.
    """


class Document(msgspec.Struct, frozen=True, kw_only=True):
    """A document people and pages read (the costs report, identity rows): every field is written, a null
    included, so a reader sees "unknown" rather than a missing key; unknown fields ignored on decode."""
