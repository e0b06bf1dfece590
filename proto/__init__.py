"""The wire contract: message types, subject/stream/bucket names, codec. Imports no service.

Every service imports ``proto``; no service imports another service. One module per link:
:mod:`proto.generate` (gateway ↔ engine), :mod:`proto.fleet` (heartbeats, energy readings),
:mod:`proto.ledger` (usage, energy samples, key energy, limit counters), :mod:`proto.admin` (auth check,
config changed, accounting SQL and costs, identity rows); :mod:`proto.subjects` names every subject and
the Struct it carries. Bus payloads are msgpack encoded with msgspec, the admin link's JSON. Schemas
evolve by appending fields with defaults; a field's type never changes; unknown fields are ignored on
decode so an older reader tolerates a newer writer.
"""

from proto.admin import (
    IDENTITY_ROWS,
    ApiKeyRow,
    AuthCheck,
    AuthReply,
    ConfigChanged,
    CostFigures,
    CostsQuery,
    CostsReport,
    DayCosts,
    ErrorDetail,
    ErrorReply,
    KeyCosts,
    LimitsRow,
    MemberCosts,
    ModelCosts,
    SqlQuery,
    SqlReply,
    UserRow,
    WindowCosts,
)
from proto.codec import ProtoDecodeError, decode, decode_json, encode, encode_json
from proto.fleet import EnergyReading, SlotHeartbeat
from proto.generate import (
    PROTOCOL_VERSION,
    Cancel,
    ChatMessage,
    Constraint,
    ErrorInfo,
    GenerateRequest,
    Timings,
    TokenChunk,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from proto.ledger import (
    EnergySample,
    KeyEnergyQuery,
    KeyEnergyReply,
    LimitCounters,
    RequestTokens,
    UsageRecord,
)

__all__ = [
    "IDENTITY_ROWS",
    "PROTOCOL_VERSION",
    "ApiKeyRow",
    "AuthCheck",
    "AuthReply",
    "Cancel",
    "ChatMessage",
    "ConfigChanged",
    "Constraint",
    "CostFigures",
    "CostsQuery",
    "CostsReport",
    "DayCosts",
    "EnergyReading",
    "EnergySample",
    "ErrorDetail",
    "ErrorInfo",
    "ErrorReply",
    "GenerateRequest",
    "KeyCosts",
    "KeyEnergyQuery",
    "KeyEnergyReply",
    "LimitCounters",
    "LimitsRow",
    "MemberCosts",
    "ModelCosts",
    "ProtoDecodeError",
    "RequestTokens",
    "SlotHeartbeat",
    "SqlQuery",
    "SqlReply",
    "Timings",
    "TokenChunk",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "UsageRecord",
    "UserRow",
    "WindowCosts",
    "decode",
    "decode_json",
    "encode",
    "encode_json",
]
